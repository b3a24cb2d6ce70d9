"""The PostgreSQL side of `kb index generations` (queries in generations.sql).

create, switch and the start of retire each run in ONE transaction; retire then deletes the
generation's rows in bounded batches, each a transaction of its own, and can be run again
after a crash (it goes on from where the state says it was).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from datetime import datetime
from typing import Any, Final

import asyncpg

from services.index.generation import IndexGeneration
from services.index.generations import SearchGeneration
from services.indexer.generations.model import (
    RETIRE_BATCH,
    AnnIndexBuild,
    CreateOutcome,
    GenerationSpec,
    GenerationStatus,
    GenerationSummary,
    Progress,
    RetireOutcome,
    SwitchOutcome,
    same_chunks,
)
from services.indexer.generations.queries import (
    QUERIES,
    default_generation,
    find_generation,
    rows_of,
)
from services.indexer.sink.generations import record_served_pointers
from services.indexer.sink.pgvector import QUERIES as SINK_QUERIES
from services.indexer.sink.pgvector import ensure_ann_index as build_model_ann_index
from services.runtime.errors import BadInput, NotFound
from services.runtime.logging import get_logger
from services.runtime.pg.db import translate_db_errors

log = get_logger(__name__)


# Pointers recorded per statement when create pins a tenant: bounded memory, few round trips.
COPY_PAGE: Final = 5_000


class PgGenerations:
    def __init__(
        self,
        pool: asyncpg.Pool[Any],
        *,
        now: datetime | None = None,
        batch_size: int = RETIRE_BATCH,
        index_build_memory: str = "1GB",
        partition_graphs: bool = False,
    ) -> None:
        self._pool = pool
        self._now = now  # tests pin the clock; otherwise the database's
        self._batch = batch_size
        self._build_memory = index_build_memory
        self._partition_graphs = partition_graphs  # KB_INDEXER_PARTITION_GRAPHS

    # --- create --------------------------------------------------------------------------

    async def create(
        self, spec: GenerationSpec, tenants: Sequence[str] | None, *, max_attempts: int
    ) -> CreateOutcome:
        """Registers the generation (or finds the live one of the same setup), then builds
        it for each tenant (None: every tenant) in a transaction of its own: pins the tenant
        to the default if it has no row, adds its row of the generation and enqueues its
        backfill, under the lock publishes take before they read a tenant's generations.
        One transaction per tenant, not one for all: publishes wait for the lock only while
        one tenant's backfill is enqueued. Interrupted, run it again: it adds what is
        missing."""
        wanted = None if tenants is None else list(tenants)
        pinned: list[str] = []
        added: list[str] = []
        enqueued = 0
        with translate_db_errors():
            async with self._pool.acquire() as conn:
                async with conn.transaction():
                    await conn.fetchval(QUERIES["lock_generations"])
                    if wanted is not None:
                        await _require_tenants(conn, wanted)
                    await default_generation(conn)
                    generation, created = await self._register(conn, spec)
                    targets = wanted or [
                        r["tenant_id"] for r in await conn.fetch(QUERIES["all_tenants"])
                    ]
                for tenant in targets:
                    async with conn.transaction():
                        await conn.fetchval(QUERIES["lock_generations"])
                        done = await self._build_for(
                            conn, generation.generation_id, tenant, max_attempts
                        )
                    pinned += done[0]
                    added += done[1]
                    enqueued += done[2]
        outcome = CreateOutcome(generation, created, pinned, added, enqueued)
        log.info(
            "generation.created" if created else "generation.extended",
            generation_id=generation.generation_id,
            model=generation.embedding_model,
            pinned=len(outcome.pinned),
            tenants_added=len(outcome.added),
            backfill_tasks=outcome.backfill_tasks,
        )
        return outcome

    async def _build_for(
        self, conn: Any, generation_id: int, tenant: str, max_attempts: int
    ) -> tuple[list[str], list[str], int]:
        """One tenant's part of `create`, under lock_generations: (pinned, added, tasks)."""
        # Read again under the lock: a retire or an indexer's new default may have committed
        # since the generation was registered.
        generation = await find_generation(conn, generation_id)
        if not generation.active:
            raise BadInput(f"{generation.describe()} is {generation.state}: not built any more")
        default = await default_generation(conn)
        only = [tenant]
        pinned = await conn.fetch(QUERIES["pin_tenants"], only, default.generation_id, self._now)
        if pinned:
            await _copy_served_pointers(conn, tenant, default)
        added = await conn.fetch(QUERIES["add_tenant_rows"], only, generation_id, self._now)
        enqueued = await conn.execute(
            QUERIES["enqueue_backfill"], only, generation_id, max_attempts, self._now
        )
        return (
            [r["tenant_id"] for r in pinned],
            [r["tenant_id"] for r in added],
            rows_of(enqueued),
        )

    async def _register(self, conn: Any, spec: GenerationSpec) -> tuple[SearchGeneration, bool]:
        live = [
            SearchGeneration.from_record(r)
            for r in await conn.fetch(QUERIES["live_generations_of_model"], spec.embedding_model)
        ]
        registered = await conn.fetchval(
            QUERIES["registered_model_dimension"], spec.embedding_model
        )
        dimensions = {g.dimension for g in live} | ({registered} if registered else set())
        if dimensions - {spec.dimension}:
            raise BadInput(
                f"model {spec.embedding_model!r} is indexed with dimension "
                f"{min(dimensions - {spec.dimension})}: a model has one dimension"
            )
        found = await conn.fetchrow(
            QUERIES["find_setup"],
            spec.provider_profile,
            spec.embedding_model,
            spec.dimension,
            spec.chunk_max_tokens,
            spec.chunk_overlap_tokens,
        )
        if found is not None:
            existing = SearchGeneration.from_record(found)
            if existing.is_default:
                raise BadInput(f"that is {existing.describe()}, the default: nothing to build")
            if not existing.active:
                raise BadInput(
                    f"{existing.describe()} is being retired: run "
                    f"`kb index generations retire {existing.generation_id}` to finish first"
                )
            return existing, False
        twins = [g for g in live if same_chunks(g, spec)]
        if twins:
            raise BadInput(
                f"{twins[0].describe()} has the same model and chunk settings under profile "
                f"{twins[0].provider_profile!r}: their chunks would be the same rows"
            )
        generation_id = await conn.fetchval(
            QUERIES["insert_generation"],
            spec.provider_profile,
            spec.embedding_model,
            spec.dimension,
            spec.chunk_max_tokens,
            spec.chunk_overlap_tokens,
            self._now,
        )
        return await find_generation(conn, generation_id), True

    async def ensure_ann_index(
        self, generation: SearchGeneration, *, wait_seconds: float = 60.0
    ) -> AnnIndexBuild:
        """Builds the model's partitioned ANN index now (CREATE INDEX CONCURRENTLY,
        partition by partition) unless it is there and valid: BUSY when another process held
        the model's lock for ``wait_seconds`` (the indexers build it when they first build
        the generation), OFF with partition graphs off (one already there is left alone, as
        the sink does). Outside any transaction."""
        if not self._partition_graphs:
            return AnnIndexBuild.OFF
        model = generation.embedding_model
        index = IndexGeneration(
            model, generation.dimension, f"search-generation-{generation.generation_id}"
        )
        with translate_db_errors():
            async with self._pool.acquire() as conn:
                if await conn.fetchval(SINK_QUERIES["ann_index_state"], index.ann_index_name):
                    return AnnIndexBuild.PRESENT
                if not await _try_lock(conn, model, wait_seconds):
                    return AnnIndexBuild.BUSY
                try:
                    await build_model_ann_index(conn, index, self._build_memory)
                finally:
                    await conn.fetchval(SINK_QUERIES["release_generation_lock"], model)
        return AnnIndexBuild.BUILT

    async def tenant_graphs(
        self, generation: SearchGeneration, tenants: Sequence[str] | None, *, min_chunks: int
    ) -> list[str] | None:
        """The HNSW graph of the model of each of ``tenants`` (None: every tenant) large
        enough to have one (``min_chunks`` served chunks, whatever their model), built now
        while the generation holds nothing of theirs: the tenants built, or None when
        another process held the model's tenant-graphs lock."""
        from services.indexer.sink.tenant_graphs import PgTenantGraphs

        graphs = PgTenantGraphs(
            self._pool, min_chunks=min_chunks, index_build_memory=self._build_memory
        )
        return await graphs.ensure_for_new_model(
            generation.embedding_model,
            generation.dimension,
            None if tenants is None else list(tenants),
        )

    # --- list and status -----------------------------------------------------------------

    async def summaries(self) -> list[GenerationSummary]:
        with translate_db_errors():
            rows = await self._pool.fetch(QUERIES["generations_overview"])
        return [
            GenerationSummary(
                SearchGeneration.from_record(r), int(r["tenants_serving"]), int(r["tenants_built"])
            )
            for r in rows
        ]

    async def status(
        self, tenant_id: str | None, *, on_disk: bool, serving_shown: int = 20
    ) -> list[GenerationStatus]:
        """Each generation not retired: its progress (for one tenant or all), the tenants it
        serves, and with ``on_disk`` its chunks and their size in knowledge_chunk."""
        with translate_db_errors():
            if tenant_id is not None and not await self._pool.fetchval(
                QUERIES["tenant_exists"], tenant_id
            ):
                raise NotFound(f"no tenant {tenant_id!r}", code="TENANT_NOT_FOUND")
            summaries = {s.generation.generation_id: s for s in await self.summaries()}
            progress = await self._pool.fetch(QUERIES["generation_progress"], tenant_id)
            found = []
            for row in progress:
                summary = summaries[row["generation_id"]]
                generation = summary.generation
                serving = await self._pool.fetch(
                    QUERIES["serving_tenants"],
                    generation.generation_id,
                    generation.is_default,
                    tenant_id,
                    serving_shown,
                )
                chunks = size = None
                if on_disk:
                    chunks, size = await self._on_disk(generation, tenant_id)
                found.append(
                    GenerationStatus(
                        summary,
                        Progress(
                            int(row["done"]),
                            int(row["pending"]),
                            int(row["failed"]),
                            int(row["chunks"]),
                        ),
                        [r["tenant_id"] for r in serving],
                        chunks,
                        size,
                    )
                )
        return found

    async def _on_disk(
        self, generation: SearchGeneration, tenant_id: str | None
    ) -> tuple[int, int]:
        if not generation.chunking_settings:
            return 0, 0
        row = await self._pool.fetchrow(
            QUERIES["chunks_on_disk"],
            generation.embedding_model,
            generation.chunking_settings,
            tenant_id,
        )
        assert row is not None
        return int(row["chunks"]), int(row["bytes"])

    # --- switch --------------------------------------------------------------------------

    async def switch(self, tenant_id: str, generation_id: int, *, force: bool) -> SwitchOutcome:
        """`kb index generations switch` (switch.py)."""
        from services.indexer.generations.switch import PgSwitch

        return await PgSwitch(self._pool, now=self._now).switch(
            tenant_id, generation_id, force=force
        )

    async def retire(self, generation_id: int) -> RetireOutcome:
        """`kb index generations retire` (retire.py)."""
        from services.indexer.generations.retire import PgRetirement

        return await PgRetirement(self._pool, now=self._now, batch_size=self._batch).retire(
            generation_id
        )


async def _copy_served_pointers(conn: Any, tenant: str, default: SearchGeneration) -> None:
    """What a just pinned tenant's documents hold in the default generation, from their
    search pointers of its model and chunk settings; a page at a time, so a large tenant's
    pointers never sit in memory at once. Completions since the indexers registered the
    default wrote records already: the sink's one upsert keeps them (forward only, a record
    at the pointer's version as its completion wrote it)."""
    after = None
    while page := await conn.fetch(
        QUERIES["served_pointers"],
        tenant,
        default.embedding_model,
        default.chunking_settings,
        after,
        COPY_PAGE,
    ):
        await record_served_pointers(conn, tenant, default.generation_id, page)
        after = page[-1]["document_id"]


async def _require_tenants(conn: Any, wanted: list[str]) -> None:
    found = {r["tenant_id"] for r in await conn.fetch(QUERIES["existing_tenants"], wanted)}
    unknown = [t for t in wanted if t not in found]
    if unknown:
        raise NotFound("no tenant " + ", ".join(map(repr, unknown)), code="TENANT_NOT_FOUND")


async def _try_lock(conn: Any, model: str, wait_seconds: float) -> bool:
    # Polled, never waited for inside PostgreSQL (sink.sql: try_generation_lock).
    deadline = time.monotonic() + wait_seconds
    pause = 0.05
    while not await conn.fetchval(SINK_QUERIES["try_generation_lock"], model):
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(pause)
        pause = min(pause * 2, 1.0)
    return True
