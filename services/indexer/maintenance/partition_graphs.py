"""`kb index partition-graphs drop`: the way off the partition graphs for a deployment that
has them (docs/operations.md, "Partition graphs").

With KB_INDEXER_PARTITION_GRAPHS off the indexers no longer build a model's partitioned HNSW
index, but one already built stays, and PostgreSQL keeps inserting every chunk into it. It
goes only when the operator says so, and only once no search needs it: every tenant at or
over the tenant-graph threshold has a valid graph of its own (a tenant under it is ranked
exactly, or walks its own graph once it crosses it). The DROP takes knowledge_chunk's ACCESS
EXCLUSIVE lock, so it gives up after a short lock_timeout and statement_timeout and tries
again a few times (pgvector.PartitionedDrop), as a generation's retire does.

Nothing is checked or dropped while another process builds the model's graphs: the model's
generation lock (an indexer building the partitioned index) and its tenant-graphs lock (a
round building tenants' graphs) are tried, never waited for, and held through the drop.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import asyncpg

from services.index.ann import ann_index_name
from services.indexer.sink.pgvector import QUERIES as SINK_QUERIES
from services.indexer.sink.pgvector import PartitionedDrop
from services.indexer.sink.tenant_graphs import QUERIES as GRAPH_QUERIES
from services.indexer.sink.tenant_graphs import PgTenantGraphs
from services.runtime.errors import DatabaseBusy
from services.runtime.logging import get_logger
from services.runtime.pg.db import translate_db_errors
from services.runtime.pg.sql import queries_beside

QUERIES = queries_beside(__file__, "partition_graphs.sql")
log = get_logger(__name__)

RERUN = "kb index partition-graphs drop"

# The model's locks the drop holds, each tried: (take, release) in sink.sql/tenant_graphs.sql.
_LOCKS = (
    (SINK_QUERIES["try_generation_lock"], SINK_QUERIES["release_generation_lock"]),
    (GRAPH_QUERIES["try_tenant_graphs_lock"], GRAPH_QUERIES["release_tenant_graphs_lock"]),
)


@dataclass(frozen=True)
class ModelDrop:
    """What the command did about one model's partitioned index."""

    model: str
    index: str
    dropped: bool
    # Tenants at or over the threshold without a valid graph of their own: the index kept.
    missing: tuple[str, ...] = ()
    # Another process held one of the model's locks (it is building): nothing checked.
    busy: bool = False
    # Parts of the model's index attached to no parent, dropped (concurrently).
    leftovers: tuple[str, ...] = ()


@dataclass(frozen=True)
class PgPartitionGraphs:
    pool: asyncpg.Pool[Any]
    _: KW_ONLY
    # Tenants of at least this many served chunks must have a valid graph of their own.
    min_chunks: int
    dropping: PartitionedDrop = field(default_factory=PartitionedDrop)

    async def models(self) -> list[str]:
        """Every registered model and every live search generation's."""
        with translate_db_errors():
            rows = await self.pool.fetch(QUERIES["models"])
        return [row["embedding_model"] for row in rows]

    async def drop(self, model: str) -> ModelDrop:
        """Drops ``model``'s partitioned index and its unattached parts unless a tenant at
        or over the threshold lacks a valid graph of its own, or another process holds the
        model's generation or tenant-graphs lock (``busy``); ``dropped`` False otherwise:
        there was none. DatabaseBusy when knowledge_chunk stayed locked through every try."""
        name = ann_index_name(model)
        with translate_db_errors():
            async with self.pool.acquire() as conn, _model_locks(conn, model) as held:
                if not held:
                    log.warning("partition_graph.busy", model=model, index=name)
                    return ModelDrop(model, name, dropped=False, busy=True)
                state = await conn.fetchval(SINK_QUERIES["ann_index_state"], name)
                # Only the model's parts (<name>_pNN), not a REINDEX CONCURRENTLY leftover
                # (<name>_pNN_ccnew) or anything else LIKE matches: each name goes into a DROP.
                part = re.compile(rf"^{re.escape(name)}_p\d+$")
                parts = [
                    row["index_name"]
                    for row in await conn.fetch(QUERIES["unattached_parts"], name)
                    if part.match(row["index_name"])
                ]
                if state is None and not parts:
                    return ModelDrop(model, name, dropped=False)
                graphs = PgTenantGraphs(self.pool, min_chunks=self.min_chunks)
                if missing := await graphs.missing(model, conn):
                    log.warning("partition_graph.kept", model=model, tenants_without_graph=missing)
                    return ModelDrop(model, name, dropped=False, missing=tuple(missing))
                if state is not None:
                    await self.dropping.run(conn, model, again=RERUN)
                await self._drop_parts(conn, name, parts)
        leftovers = tuple(parts)
        log.info("partition_graph.dropped", model=model, index=name, leftovers=leftovers)
        return ModelDrop(model, name, dropped=state is not None, leftovers=leftovers)

    async def _drop_parts(self, conn: Any, name: str, parts: Sequence[str]) -> None:
        """Unattached parts block nothing: each goes concurrently, without knowledge_chunk's
        lock. It still waits for the transactions on its partition, holding the model's locks
        meanwhile: each wait is bounded by the parent drop's lock_timeout (a session setting,
        as DROP INDEX CONCURRENTLY runs in no transaction), set back afterwards since the
        indexer's pool does not reset sessions. DatabaseBusy (exit 1) after a timeout."""
        if not parts:
            return
        await conn.fetchval(QUERIES["set_session_lock_timeout"], self.dropping.lock_timeout)
        try:
            for part in parts:
                await conn.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {part}")
        except asyncpg.LockNotAvailableError as error:
            raise DatabaseBusy(
                f"index {name}: a part's partition stayed in use by other transactions; "
                f"run `{RERUN}` again"
            ) from error
        finally:
            await conn.execute(QUERIES["reset_lock_timeout"])


@asynccontextmanager
async def _model_locks(conn: Any, model: str) -> AsyncIterator[bool]:
    """The model's generation and tenant-graphs locks, tried on ``conn`` (session-level,
    never waited for: a session waiting holds a snapshot a builder's CREATE INDEX
    CONCURRENTLY would wait for); True when both are held, released on the way out."""
    taken: list[str] = []
    try:
        for take, release in _LOCKS:
            if not await conn.fetchval(take, model):
                yield False
                return
            taken.append(release)
        yield True
    finally:
        for release in reversed(taken):
            await conn.fetchval(release, model)
