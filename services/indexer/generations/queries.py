"""The named queries of `kb index generations` (generations.sql), loaded once for the store
(store_pg.py), the switch (switch.py) and the retirement
(retire.py), and the lookups they share."""

from __future__ import annotations

from typing import Any

from services.index.generations import SearchGeneration
from services.runtime.errors import BadInput, NotFound
from services.runtime.pg.sql import queries_beside

QUERIES = queries_beside(__file__, "generations.sql")


def rows_of(status: str) -> int:
    """The row count of a command tag ("DELETE 12", "INSERT 0 7", "UPDATE 3")."""
    return int(status.rsplit(" ", 1)[-1])


async def find_generation(conn: Any, generation_id: int) -> SearchGeneration:
    row = await conn.fetchrow(QUERIES["find_generation"], generation_id)
    if row is None:
        raise NotFound(f"no generation {generation_id}", code="GENERATION_NOT_FOUND")
    return SearchGeneration.from_record(row)


async def default_generation(conn: Any, *, built: bool = True) -> SearchGeneration:
    row = await conn.fetchrow(QUERIES["default_generation"])
    if row is None:
        raise BadInput(
            "no default generation is registered yet: start the indexers (`kb indexer run`) "
            "with this release once, they register theirs"
        )
    default = SearchGeneration.from_record(row)
    if built and not default.chunking_settings:
        raise BadInput(
            f"{default.describe()} has no chunk settings recorded yet: start an indexer once"
        )
    return default
