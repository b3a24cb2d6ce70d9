"""`kb index partition-graphs drop`: the way off the partition graphs for a deployment that
has them (docs/operations.md, "Upgrade: partition graphs off").

With KB_INDEXER_PARTITION_GRAPHS off the indexers no longer build a model's partitioned HNSW
index, but one already built stays, and PostgreSQL keeps inserting every chunk into it. It
goes only when the operator says so, and only once no search needs it: every tenant at or
over the tenant-graph threshold has a valid graph of its own (a tenant under it is ranked
exactly, or walks its own graph once it crosses it). The DROP takes knowledge_chunk's ACCESS
EXCLUSIVE lock, so it gives up after a short lock_timeout and tries again a few times
(pgvector.PartitionedDrop), as a generation's retire does.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import asyncpg

from services.index.ann import ann_index_name
from services.indexer.sink.pgvector import QUERIES as SINK_QUERIES
from services.indexer.sink.pgvector import PartitionedDrop, PgVectorSink
from services.indexer.sink.tenant_graphs import PgTenantGraphs
from services.runtime.logging import get_logger
from services.runtime.pg.db import translate_db_errors

log = get_logger(__name__)

RERUN = "kb index partition-graphs drop"


@dataclass(frozen=True)
class ModelDrop:
    """What the command did about one model's partitioned index."""

    model: str
    index: str
    dropped: bool
    # Tenants at or over the threshold without a valid graph of their own: the index kept.
    missing: tuple[str, ...] = ()


@dataclass(frozen=True)
class PgPartitionGraphs:
    pool: asyncpg.Pool[Any]
    _: KW_ONLY
    # Tenants of at least this many served chunks must have a valid graph of their own.
    min_chunks: int
    dropping: PartitionedDrop = field(default_factory=PartitionedDrop)

    async def models(self) -> list[str]:
        """Every registered model (each generation's index is named after its model)."""
        registered = await PgVectorSink(self.pool).generations()
        return sorted({g.generation.embedding_model for g in registered})

    async def drop(self, model: str) -> ModelDrop:
        """Drops ``model``'s partitioned index unless a tenant at or over the threshold
        lacks a valid graph of its own; ``dropped`` False with no ``missing``: there was
        none. DatabaseBusy when knowledge_chunk stayed locked through every try."""
        name = ann_index_name(model)
        with translate_db_errors():
            if await self.pool.fetchval(SINK_QUERIES["ann_index_state"], name) is None:
                return ModelDrop(model, name, dropped=False)
            missing = await PgTenantGraphs(self.pool, min_chunks=self.min_chunks).missing(model)
            if missing:
                log.warning(
                    "partition_graph.kept", model=model, index=name, tenants_without_graph=missing
                )
                return ModelDrop(model, name, dropped=False, missing=tuple(missing))
            async with self.pool.acquire() as conn:
                await self.dropping.run(conn, name, again=RERUN)
        log.info("partition_graph.dropped", model=model, index=name)
        return ModelDrop(model, name, dropped=True)
