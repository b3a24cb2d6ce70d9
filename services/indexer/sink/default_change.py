"""An indexer started with another embedding model than the default generation's
(``KB_EMBEDDING_*`` changed) would register a new default at once: every tenant without a
generation of its own -- never pinned by `kb index generations create` -- would then embed
its queries with a model none of its search pointers names, and its hybrid search would
quietly compare vectors of two models. So the start is refused (a ConfigError: `kb indexer
run` exits 2) while any such tenant has a searchable document, naming both models, the
tenants and the way through (docs/operations.md#changing-the-embedding-model): build the
new setup for them with `create`, `switch` them, then restart. Pinning them to the old
default here instead was the other choice; it was not taken: the old default's pipeline is
built from the ``default`` profile, which no longer names its model, so their publishes
would fail instead.

A change of chunk sizes alone keeps the model: queries and pointers still agree, and the
start goes ahead as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

from services.index.generations import SearchGeneration
from services.runtime.errors import ConfigError
from services.runtime.pg.sql import queries_beside

if TYPE_CHECKING:
    import asyncpg

QUERIES = queries_beside(__file__, "generations.sql")

DEFAULT_CHANGE_REFUSED: Final = "DEFAULT_GENERATION_CHANGE_REFUSED"
_NAMED: Final = 10  # tenants named in the message


async def refuse_moving_searches(
    conn: asyncpg.Connection[Any] | asyncpg.pool.PoolConnectionProxy[Any],
    *,
    model: str,
    dimension: int,
) -> None:
    """Raises a ConfigError when the default generation embeds with another model than
    ``model``/``dimension`` and some tenant searches through it; run under the lock the
    registration holds (lock_search_generations), before anything is written."""
    row = await conn.fetchrow(QUERIES["default_search_generation"])
    if row is None:
        return  # the first start: nobody searches yet
    current = SearchGeneration.from_record(row)
    if (current.embedding_model, current.dimension) == (model, dimension):
        return
    tenants = await conn.fetch(QUERIES["tenants_searching_the_default"], _NAMED)
    if not tenants:
        return
    total = tenants[0]["total"]
    names = ", ".join(r["tenant_id"] for r in tenants) + (", ..." if total > len(tenants) else "")
    raise ConfigError(
        f"KB_EMBEDDING_* changed: the default search generation is {current.describe()}, "
        f"this indexer is configured for {model} ({dimension} dimensions). {total} tenants "
        f"have no generation of their own and search through the default ({names}): a new "
        "default would embed their queries with a model none of their documents was "
        "indexed with. Restore the previous KB_EMBEDDING_* settings, or first build the new "
        "model for them: `kb index generations create --provider <profile> "
        f"--model {model} --dimensions {dimension} --all`, wait for the backfill (`kb index "
        "generations status`), `kb index generations switch --tenant <tenant> --to <id>` "
        "each tenant, then restart the indexers (docs/operations.md, changing the embedding "
        "model)",
        code=DEFAULT_CHANGE_REFUSED,
    )
