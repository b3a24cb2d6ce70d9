"""Search generations in the indexer's sink (generations.sql, migration 0022,
docs/architecture.md#index-generations): the default registered at indexer start, the
generation a task builds, and what its fenced completion does about it.

A completion builds one generation. It records the document's version in that generation
(``document_generation_version``) whichever it is; it moves the search pointer only when that
generation serves the tenant at commit. Superseded chunks, of any generation, are left to
the collector (services/indexer/gc). A task enqueued for "the tenant's
serving generation" (no generation named) whose generation stopped serving while it ran is
completed into the generation it was resolved to, beside the serving one: that generation
keeps the version for a rollback, and the generation that serves now has the version through
its own task (the publish's dual write, or `create`'s backfill of every published version).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from services.index.generation import IndexGeneration, chunking_settings
from services.index.generations import DEFAULT_PROFILE, SearchGeneration
from services.indexer.sink.default_change import refuse_moving_searches
from services.indexer.task import Lease
from services.runtime.errors import ConfigError
from services.runtime.logging import get_logger
from services.runtime.pg.coalesce import Coalesced
from services.runtime.pg.db import translate_db_errors
from services.runtime.pg.sql import queries_beside
from services.runtime.pg.transaction import Transaction

if TYPE_CHECKING:
    import asyncpg

QUERIES = queries_beside(__file__, "generations.sql")

log = get_logger(__name__)


@dataclass(frozen=True)
class CompletionTarget:
    """What a completion does with its generation, decided under lock_completion_generation:
    ``write`` False: the generation is being retired, nothing is written; ``serving``: it
    serves the tenant, so the pointer moves to it."""

    generation_id: int
    write: bool
    serving: bool


async def register_default(
    conn: asyncpg.Connection[Any] | asyncpg.pool.PoolConnectionProxy[Any],
    generation: IndexGeneration,
    *,
    chunk_max_tokens: int,
    chunk_overlap_tokens: int,
    now: datetime | None = None,
) -> SearchGeneration:
    """The search generation of the indexer's configuration (profile ``default``), made the
    default: found or created, its chunking settings recorded if not yet known. One
    transaction under the exclusive advisory lock: concurrent starts register it once.
    Refused (ConfigError) when it would move searches to another model
    (default_change.py)."""
    settings = chunking_settings(generation.chunking_strategy)
    key = (
        DEFAULT_PROFILE,
        generation.embedding_model,
        generation.dimension,
        chunk_max_tokens,
        chunk_overlap_tokens,
    )
    with translate_db_errors():
        async with conn.transaction():
            await conn.fetchval(QUERIES["lock_search_generations"])
            await refuse_moving_searches(
                conn, model=generation.embedding_model, dimension=generation.dimension
            )
            row = await conn.fetchrow(QUERIES["find_live_search_generation"], *key)
            if row is None:
                row = await conn.fetchrow(QUERIES["insert_search_generation"], *key, now)
                assert row is not None
            found = SearchGeneration.from_record(row)
            if not found.active:
                raise ConfigError(
                    f"the configured embedding setup is {found.describe()}, which is being "
                    "retired: finish `kb index generations retire` first, or configure another"
                )
            await conn.execute(QUERIES["clear_other_defaults"], found.generation_id)
            row = await conn.fetchrow(
                QUERIES["make_default_search_generation"], found.generation_id, settings
            )
    assert row is not None
    default = SearchGeneration.from_record(row)
    _check_settings(default, settings)
    log.info(
        "search_generation.registered",
        generation_id=default.generation_id,
        embedding_model=default.embedding_model,
        dimension=default.dimension,
        chunking_settings=default.chunking_settings,
    )
    return default


async def record_chunking_settings(
    conn: asyncpg.Connection[Any] | asyncpg.pool.PoolConnectionProxy[Any] | asyncpg.Pool[Any],
    search: SearchGeneration,
    generation: IndexGeneration,
) -> SearchGeneration:
    """``search`` with its chunking settings recorded (by the first indexer that builds it):
    what names its chunks in knowledge_chunk (`kb index generations status` and `retire`)."""
    settings = chunking_settings(generation.chunking_strategy)
    with translate_db_errors():
        row = await conn.fetchrow(
            QUERIES["record_chunking_settings"], search.generation_id, settings
        )
    if row is None:
        raise ConfigError(f"{search.describe()} no longer exists")
    recorded = SearchGeneration.from_record(row)
    _check_settings(recorded, settings)
    return recorded


def _check_settings(search: SearchGeneration, settings: str) -> None:
    if search.chunking_settings != settings:
        # Chunks of these settings are not counted as the generation's (status, retire):
        # said loudly, never fatal (the tokenizer's cap may differ between installs).
        log.warning(
            "search_generation.chunking_settings_differ",
            generation_id=search.generation_id,
            recorded=search.chunking_settings,
            chunking=settings,
        )


# A task's question for task_generations: its tenant, and the generation it names (None:
# the tenant's serving one).
GenerationQuestion = tuple[str, int | None]


class TaskGenerations:
    """The generation a task builds: the one it names, else the tenant's serving one, else
    the default; ``None`` when none exists (no indexer registered one). The tasks of many
    slots asking at once share one query (services/runtime/pg/coalesce.py)."""

    def __init__(self, pool: asyncpg.Pool[Any]) -> None:
        self._pool = pool
        self._asked: Coalesced[GenerationQuestion, SearchGeneration] = Coalesced(self._read)

    async def __call__(self, lease: Lease) -> SearchGeneration | None:
        return await self._asked.get((lease.tenant_id, lease.generation_id))

    async def _read(
        self, questions: Sequence[GenerationQuestion]
    ) -> Mapping[GenerationQuestion, SearchGeneration]:
        with translate_db_errors():
            rows = await self._pool.fetch(
                QUERIES["task_search_generations"],
                [tenant_id for tenant_id, _ in questions],
                [generation_id for _, generation_id in questions],
            )
        return {
            (row["asked_tenant_id"], row["asked_generation_id"]): SearchGeneration.from_record(row)
            for row in rows
        }


# What the completions written share of their target: tenant, generation, named.
TargetKey = tuple[str, int, bool]


async def lock_targets(
    conn: Transaction, leases_by_key: Mapping[TargetKey, Sequence[Lease]]
) -> dict[TargetKey, CompletionTarget]:
    """The first step of completions that build search generations: each tenant's serving
    generation locked (generations.sql: lock_completion_generation), and what each
    completion may do; once per (tenant, generation, named) in key order, one statement
    (two when a generation stopped serving meanwhile)."""
    keys = sorted(leases_by_key)
    rows = await _lock_completion_generations(conn, keys)
    again = [
        key for key, row in zip(keys, rows, strict=True) if not key[2] and row["serving"] != key[1]
    ]
    state_of = {key: row["state"] for key, row in zip(keys, rows, strict=True)}
    serving_of = {key: row["serving"] for key, row in zip(keys, rows, strict=True)}
    if again:
        for key in again:
            _log_no_longer_serving(leases_by_key[key], key[1], serving_of[key])
        # Built beside the serving generation, as a named task would be: its state locked.
        named_rows = await _lock_completion_generations(conn, [(t, g, True) for t, g, _ in again])
        for key, row in zip(again, named_rows, strict=True):
            state_of[key] = row["state"]
    return {
        key: _target(leases_by_key[key], key[1], serving_of[key], state_of[key]) for key in keys
    }


async def _lock_completion_generations(conn: Transaction, keys: Sequence[TargetKey]) -> list[Any]:
    with translate_db_errors():
        rows: list[Any] = await conn.fetch(
            QUERIES["lock_completion_generation"],
            [tenant_id for tenant_id, _, _ in keys],
            [generation_id for _, generation_id, _ in keys],
            [named for _, _, named in keys],
        )
    assert len(rows) == len(keys)
    return rows


def _log_no_longer_serving(leases: Sequence[Lease], generation_id: int, serving: Any) -> None:
    # Switched away while the task ran: built beside the serving generation, as a named task
    # would be -- so its state is locked too (retire may be under way).
    for lease in leases:
        log.info(
            "task.generation_no_longer_serving",
            **lease.log_fields(),
            generation_id=generation_id,
            serving_generation_id=serving,
        )


def _target(
    leases: Sequence[Lease], generation_id: int, serving: Any, state: str | None
) -> CompletionTarget:
    if state is not None and state != "ACTIVE":
        for lease in leases:
            log.info(
                "task.generation_retired",
                **lease.log_fields(),
                generation_id=generation_id,
                state=state,
            )
        return CompletionTarget(generation_id, write=False, serving=False)
    return CompletionTarget(generation_id, write=True, serving=serving == generation_id)


async def record_versions(
    conn: Transaction,
    versions: Sequence[tuple[Lease, int, IndexGeneration, int]],
    now: datetime | None,
) -> None:
    """Each completed version recorded in its target generation (forward only; the same
    version rewritten: the completion built it): a (lease, the target generation's id, its
    index generation, its chunk count) each, in the order given ((tenant, document) order:
    one row per document and generation)."""
    if not versions:
        return
    await _upsert_records(
        conn,
        [lease.tenant_id for lease, _, _, _ in versions],
        [lease.document_id for lease, _, _, _ in versions],
        [lease.version_number for lease, _, _, _ in versions],
        [generation.chunking_strategy for _, _, generation, _ in versions],
        [count for _, _, _, count in versions],
        [generation_id for _, generation_id, _, _ in versions],
        [lease.task_id for lease, _, _, _ in versions],
        now=now,
        built_at=None,
        built_here=True,
    )


async def record_served_pointers(
    conn: Transaction, tenant_id: str, generation_id: int, pointers: Sequence[Mapping[str, Any]]
) -> None:
    """A pinned tenant's served pointers (``document_id``, ``version_number``,
    ``chunking_strategy``, ``chunk_count``, ``task_id``, ``switched_at`` each) recorded in
    the generation that serves them: a record moves forward or is added, one at the
    pointer's version stays as its completion wrote it."""
    if not pointers:
        return
    await _upsert_records(
        conn,
        [tenant_id] * len(pointers),
        [p["document_id"] for p in pointers],
        [p["version_number"] for p in pointers],
        [p["chunking_strategy"] for p in pointers],
        [p["chunk_count"] for p in pointers],
        [generation_id] * len(pointers),
        [p["task_id"] for p in pointers],
        now=None,
        built_at=[p["switched_at"] for p in pointers],
        built_here=False,
    )


async def _upsert_records(
    conn: Transaction,
    *columns: Sequence[Any],
    now: datetime | None,
    built_at: Sequence[datetime] | None,
    built_here: bool,
) -> None:
    with translate_db_errors():
        await conn.execute(
            QUERIES["upsert_document_generation_version"], *columns, now, built_at, built_here
        )


async def discard_task_stream(conn: Transaction, lease: Lease) -> None:
    with translate_db_errors():
        await conn.execute(QUERIES["discard_task_stream"], lease.task_id)
