"""A large tenant's own HNSW graph of a model, kept by the indexer.

Every search is within one tenant. A partition's graph (index/ann.py; built only with
KB_INDEXER_PARTITION_GRAPHS) holds the few tenants hashed to that partition, so a search
walks past the others' chunks and needs a longer candidate list (ef_search), and more time,
for the same recall than a graph of the tenant's chunks alone (BENCHMARKS.md); without
partition graphs a tenant's own is the only graph there is. So each tenant whose current
versions hold at least ``min_chunks`` chunks of the model gets a partial HNSW index of its
own on its partition (ann.create_tenant_ann_index_sql); a smaller tenant is ranked exactly
by search anyway (``KB_SEARCH_EXACT_MAX_CHUNKS``), which is why the two thresholds share
their default.

Built with CREATE INDEX CONCURRENTLY, one tenant at a time, by whichever indexer process
takes the model's tenant-graphs lock; the others skip that model. A round reads the large
tenants of every model the search pointers name in one pass (``large_by_model``) and takes
the lock only of a model that has one; a live generation's model no pointer names yet needs
nothing from it (`kb index generations create` built its graphs, ``ensure_for_new_model``).
One tenant's failed build is logged and the next tenant's goes on. A model of more
dimensions than HNSW takes (``HNSW_MAX_DIMENSION``) gets none. A graph is never dropped here,
except an INVALID one (an interrupted build), which is dropped and built again.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import asyncpg

from services.index.ann import (
    HNSW_MAX_DIMENSION,
    create_tenant_ann_index_sql,
    drop_tenant_ann_index_sql,
    tenant_ann_index_name,
)
from services.indexer.sink.pgvector import QUERIES as SINK_QUERIES
from services.indexer.sink.pgvector import index_build_session
from services.runtime.errors import DatabaseUnavailable
from services.runtime.logging import get_logger
from services.runtime.pg.db import translate_db_errors
from services.runtime.pg.sql import queries_beside
from services.runtime.signals import unless_stopped

QUERIES = queries_beside(__file__, "tenant_graphs.sql")
log = get_logger(__name__)

# A model, its dimension and its large tenants' rows (large_tenants_by_model), largest first.
ModelTenants = tuple[str, int, list[Any]]


class PgTenantGraphs:
    def __init__(
        self,
        pool: asyncpg.Pool[Any],
        *,
        min_chunks: int,
        index_build_memory: str = "1GB",
    ) -> None:
        self._pool = pool
        self._min_chunks = min_chunks
        self._build_memory = index_build_memory

    async def ensure(self, model: str, dimension: int) -> list[str] | None:
        """Builds the graph of every tenant that has reached ``min_chunks`` chunks and has
        none (or an INVALID one); returns the tenants built, or None when another process
        holds the model's lock (it is building them)."""
        return await self._ensure(
            model,
            dimension,
            lambda conn: conn.fetch(QUERIES["large_tenants"], model, self._min_chunks, None),
        )

    async def ensure_for_new_model(
        self, model: str, dimension: int, tenants: list[str] | None
    ) -> list[str] | None:
        """The same for a model no pointer names yet (a generation just created, before its
        backfill): each of ``tenants`` (None: every tenant) whose served chunks, of whatever
        model, reach ``min_chunks`` gets its graph of ``model`` now, so that it is there when
        the tenant switches to it."""
        return await self._ensure(
            model,
            dimension,
            lambda conn: conn.fetch(QUERIES["large_tenants"], None, self._min_chunks, tenants),
        )

    async def missing(self, model: str, conn: Any = None) -> list[str]:
        """The tenants of at least ``min_chunks`` served chunks of ``model`` that have no
        valid graph of their own (none yet, or an INVALID one), the largest first. On
        ``conn`` when given (a caller holding the pool's one connection), else the pool's."""
        if conn is None:
            with translate_db_errors():
                async with self._pool.acquire() as conn:
                    return await self.missing(model, conn)
        missing: list[str] = []
        with translate_db_errors():
            dimension = await conn.fetchval(QUERIES["model_dimension"], model)
            if dimension is not None and dimension > HNSW_MAX_DIMENSION:
                return []  # no graph can be built: its tenants are ranked exactly by design
            large = await conn.fetch(QUERIES["large_tenants"], model, self._min_chunks, None)
            for row in large:
                name = tenant_ann_index_name(model, row["tenant_id"])
                if await conn.fetchval(SINK_QUERIES["ann_index_state"], name) is not True:
                    missing.append(row["tenant_id"])
        return missing

    async def large_by_model(self) -> list[ModelTenants]:
        """Each model whose search pointers give a tenant at least ``min_chunks`` chunks,
        with its dimension and those tenants, the largest first: one pass over the pointers
        for every model."""
        if self._min_chunks <= 0:
            return []
        found: list[ModelTenants] = []
        with translate_db_errors():
            async with self._pool.acquire() as conn:
                rows = await conn.fetch(QUERIES["large_tenants_by_model"], self._min_chunks)
                for model, large in itertools.groupby(rows, key=lambda row: row["embedding_model"]):
                    dimension = await conn.fetchval(QUERIES["model_dimension"], model)
                    if dimension is not None:
                        found.append((model, dimension, list(large)))
        return found

    async def ensure_tenants(
        self, model: str, dimension: int, large: Sequence[Any]
    ) -> list[str] | None:
        """``ensure`` for the tenants ``large`` (rows of ``large_by_model``) already read."""

        async def given(_conn: Any) -> Sequence[Any]:
            return large

        return await self._ensure(model, dimension, given)

    async def ensure_every_model(self) -> dict[str, list[str] | None]:
        """One round: ``ensure_tenants`` for each model of ``large_by_model``, each under its
        own lock (None: another process holds that model's). A model whose round fails is
        logged and left to the next round; the others go on."""
        done: dict[str, list[str] | None] = {}
        for model, dimension, large in await self.large_by_model():
            try:
                done[model] = await self.ensure_tenants(model, dimension, large)
            except Exception as error:
                log.warning("tenant_graph.round_failed", model=model, error=repr(error))
        return done

    async def _ensure(
        self, model: str, dimension: int, large_tenants: Callable[[Any], Awaitable[Sequence[Any]]]
    ) -> list[str] | None:
        if self._min_chunks <= 0:
            return []
        if dimension > HNSW_MAX_DIMENSION:
            # The build would fail and leave an INVALID index to drop and build again.
            log.warning(
                "tenant_graph.dimension_unsupported",
                model=model,
                dimension=dimension,
                max_dimension=HNSW_MAX_DIMENSION,
            )
            return []
        built: list[str] = []
        with translate_db_errors():
            async with self._pool.acquire() as conn:
                if not await conn.fetchval(QUERIES["try_tenant_graphs_lock"], model):
                    return None
                try:
                    for row in await large_tenants(conn):
                        if await self._build_one(conn, model, dimension, row):
                            built.append(row["tenant_id"])
                finally:
                    await conn.fetchval(QUERIES["release_tenant_graphs_lock"], model)
        return built

    async def _build_one(self, conn: Any, model: str, dimension: int, row: Any) -> bool:
        """True when it built the tenant's graph. A failed build is logged and False: the
        next tenant's goes on (one tenant whose build always fails would otherwise keep every
        smaller one from its graph), and the next round tries it again. A connection gone
        fails the model's round (every next build would fail the same)."""
        tenant = row["tenant_id"]
        try:
            with translate_db_errors():
                made = await _ensure_tenant_graph(
                    conn, model, dimension, tenant, self._build_memory
                )
        except DatabaseUnavailable:
            raise
        except Exception as error:
            cause = error.__cause__
            log.warning(
                "tenant_graph.build_failed",
                model=model,
                tenant_id=tenant,
                code=getattr(error, "code", type(error).__name__),
                sqlstate=getattr(cause, "sqlstate", None),
                error=repr(error),
            )
            if isinstance(cause, asyncpg.InsufficientResourcesError):
                raise  # out of disk or memory: every next build would fail the same way
            # The INVALID index a failed CREATE INDEX CONCURRENTLY leaves is still kept up
            # by every insert of the tenant until the next round: dropped now if it can be.
            with contextlib.suppress(Exception):
                await conn.execute(drop_tenant_ann_index_sql(model, tenant))
            return False
        if made:
            log.info(
                "tenant_graph.built",
                model=model,
                tenant_id=tenant,
                chunks=row["chunks"],
                index=tenant_ann_index_name(model, tenant),
            )
        return made

    async def run(self, stop: asyncio.Event, *, interval_seconds: float) -> None:
        """``ensure_every_model`` now and every ``interval_seconds`` until ``stop``; a failed
        round is logged and tried again at the next. ``stop`` cuts a build short (a large
        tenant's takes minutes, longer than a shutdown's grace): the index it leaves INVALID
        is dropped and built again by the next round, here or in another process."""
        while not stop.is_set():
            building = await unless_stopped(self.ensure_every_model(), stop)
            if building.cancelled():
                log.info("tenant_graph.round_stopped")
                return
            if (error := building.exception()) is not None:
                # A round fails alone (the database away, say); the next one tries again.
                log.warning("tenant_graph.round_failed", error=repr(error))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=interval_seconds)


async def _ensure_tenant_graph(
    conn: Any, model: str, dimension: int, tenant: str, build_memory: str
) -> bool:
    """True when it built the tenant's graph, False when a valid one was there (or the
    tenant has no chunk to build it on)."""
    name = tenant_ann_index_name(model, tenant)
    valid = await conn.fetchval(SINK_QUERIES["ann_index_state"], name)
    if valid is True:
        return False
    async with index_build_session(conn, build_memory):
        if valid is False:
            log.warning("tenant_graph.invalid_dropped", model=model, tenant_id=tenant, index=name)
            await conn.execute(drop_tenant_ann_index_sql(model, tenant))
        partition = await conn.fetchval(QUERIES["tenant_partition"], tenant)
        if partition is None:  # no chunk left (all deleted since its pointers were read)
            return False
        await conn.execute(create_tenant_ann_index_sql(model, dimension, partition, tenant))
    return True
