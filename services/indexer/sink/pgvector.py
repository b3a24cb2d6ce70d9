"""The indexer's sink on PostgreSQL + pgvector: the one short fenced transaction that makes a
document version searchable, the reuse of embeddings already in the index, and the
registration of index generations (with, when KB_INDEXER_PARTITION_GRAPHS is on, their model's
partitioned ANN index).

The write runs inside ``PgTaskQueue.complete``'s transaction, after the fenced UPDATE that
marks the task SUCCEEDED (the task row is locked by then): chunks, the forward-only search
pointer, the document's mark for the collector of superseded versions (services/indexer/gc)
and the ``DocumentSearchVersionSwitched`` outbox event commit together with the task or not
at all.
A re-run at the version already served (a repair, a chunker upgrade) replaces that
version's chunk set and rewrites the pointer's strategy and count in the same transaction
(sink.sql: ``replace_version_chunks``). Everything slow (parsing, embedding, building the
rows) happens before it. The statements are together.py's, whether one completion is
written or a group of them.

A write names the search generation it builds (generations.py): it first locks the tenant's
serving generation, records the version in ``document_generation_version``, and moves the
pointer only when its generation serves the tenant. Superseded versions are never deleted
here: the collector does it later, in bounded batches of its own, keeping
KB_INDEX_KEEP_PREVIOUS versions (gc.sql says why that is safe).

The pool must come from ``services.runtime.pg.db.create_pool`` (it registers pgvector's binary
codec for ``vector``, which the COPY and the reuse lookup use).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias

import asyncpg
import numpy as np
import numpy.typing as npt

from services.index.ann import (
    ann_index_name,
    attach_partition_ann_index_sql,
    create_parent_ann_index_sql,
    create_partition_ann_index_sql,
    drop_ann_index_sql,
    drop_partition_ann_index_sql,
    partition_ann_index_name,
)
from services.index.generation import IndexGeneration, RegisteredGeneration
from services.index.generations import SearchGeneration
from services.indexer.ports import Clock, DatabaseClock, InTransaction
from services.indexer.sink.generations import (
    register_default,
)
from services.indexer.sink.known import KnownEmbeddings
from services.indexer.sink.stream import chunk_records, discard_attempt, stage_slice
from services.indexer.sink.together import write_together
from services.indexer.sink.write import (
    ChunkWrite,
    log,
    prepare_write,
)
from services.indexer.task import Lease
from services.runtime.errors import ConfigError, DatabaseBusy
from services.runtime.messaging.avro import SchemaRegistry, default_registry
from services.runtime.pg.db import translate_db_errors
from services.runtime.pg.sql import queries_beside
from services.runtime.pg.transaction import Transaction

if TYPE_CHECKING:
    from services.indexer.chunk import Chunk

QUERIES = queries_beside(__file__, "sink.sql")

# A connection of the pool, or one opened on its own: both run the same queries.
Executor: TypeAlias = "asyncpg.Connection[Any] | asyncpg.pool.PoolConnectionProxy[Any]"


class VersionWrite:
    """The write of one version's chunks (``PgVectorSink.writer``): run as itself in a
    completion's transaction, or with others of a group through ``together``
    (``WritableTogether``, together.py)."""

    def __init__(self, sink: PgVectorSink, prepared: ChunkWrite) -> None:
        self._sink = sink
        self.prepared = prepared

    @property
    def lease(self) -> Lease:
        return self.prepared.lease

    @property
    def together(self) -> Callable[[Transaction, Sequence[Any]], Awaitable[None]]:
        return self._sink.write_together

    async def __call__(self, conn: Transaction) -> None:
        await self._sink.write(conn, self.prepared)


class PgVectorSink:
    def __init__(
        self,
        pool: asyncpg.Pool[Any],
        *,
        clock: Clock | None = None,
        registry: SchemaRegistry | None = None,
        generation_lock_timeout_seconds: float = 3600.0,
        write_timeout_seconds: float = 30.0,
        write_timeout_per_chunk_seconds: float = 0.05,
        index_build_memory: str = "1GB",
        partition_graphs: bool = False,
    ) -> None:
        self._pool = pool
        self._clock = clock or DatabaseClock()
        self._registry = registry or default_registry()
        self._lock_timeout = generation_lock_timeout_seconds
        self._write_timeout = write_timeout_seconds
        self._write_timeout_per_chunk = write_timeout_per_chunk_seconds
        self._index_build_memory = index_build_memory
        # KB_INDEXER_PARTITION_GRAPHS: whether the model's partitioned HNSW index is built.
        self._partition_graphs = partition_graphs
        self._known = KnownEmbeddings(pool)

    def write_timeout_ms(self, chunk_count: int) -> int:
        """The statement timeout of one write. Inserting into the HNSW index costs time per
        row, more on a loaded machine (BENCHMARKS.md), so a long document's chunks would
        outlast the pool's fixed statement_timeout and time out on every retry."""
        seconds = self._write_timeout + self._write_timeout_per_chunk * chunk_count
        return max(1, round(seconds * 1000))

    async def ensure_generation(self, generation: IndexGeneration) -> None:
        """Register ``generation`` and, with partition graphs on, build its model's
        partitioned HNSW index if it is missing or INVALID (left behind by an interrupted
        build). Safe from many workers at once: one builds while the others wait for it,
        then find the index valid. With them off an index already there is left alone:
        dropping it takes knowledge_chunk's ACCESS EXCLUSIVE lock (`kb index
        partition-graphs drop` does it, when the operator says so)."""
        model = generation.embedding_model
        # The connection too: one the pool cannot make (the server restarting) is the
        # database away, not a bug (a lazily built generation's task would die of it).
        with translate_db_errors():
            async with self._pool.acquire() as conn:
                await self._lock_generation(conn, model)
                try:
                    await self._register(conn, generation)
                    if self._partition_graphs:
                        await ensure_ann_index(conn, generation, self._index_build_memory)
                finally:
                    await conn.fetchval(QUERIES["release_generation_lock"], model)

    async def register_default(
        self, generation: IndexGeneration, *, chunk_max_tokens: int, chunk_overlap_tokens: int
    ) -> SearchGeneration:
        """The search generation the indexer is configured with, registered as the default
        (generations.py: register_default); run at start, after ``ensure_generation``."""
        with translate_db_errors():
            async with self._pool.acquire() as conn:
                return await register_default(
                    conn,
                    generation,
                    chunk_max_tokens=chunk_max_tokens,
                    chunk_overlap_tokens=chunk_overlap_tokens,
                    now=self._clock.now(),
                )

    async def _lock_generation(self, conn: Executor, model: str) -> None:
        # Polled, never waited for inside PostgreSQL: see try_generation_lock in sink.sql.
        deadline = time.monotonic() + self._lock_timeout
        pause = 0.05
        while True:
            with translate_db_errors():
                if await conn.fetchval(QUERIES["try_generation_lock"], model):
                    return
            if time.monotonic() >= deadline:
                raise DatabaseBusy(
                    f"index generation of {model!r}: another worker held its lock for "
                    f"over {self._lock_timeout:.0f}s"
                )
            await asyncio.sleep(pause)
            pause = min(pause * 2, 1.0)

    async def _register(self, conn: Executor, generation: IndexGeneration) -> None:
        dimension = await conn.fetchval(
            QUERIES["register_generation"],
            generation.embedding_model,
            generation.chunking_strategy,
            generation.dimension,
            generation.ann_index_name,
            json.dumps(dict(generation.chunking_code)) if generation.chunking_code else None,
            self._clock.now(),
        )
        if dimension != generation.dimension:
            raise ConfigError(
                f"embedding model {generation.embedding_model!r} is indexed with dimension "
                f"{dimension}, not {generation.dimension}: a model has one dimension"
            )

    async def generations(self) -> list[RegisteredGeneration]:
        with translate_db_errors():
            rows = await self._pool.fetch(QUERIES["list_generations"])
        return [
            RegisteredGeneration(
                IndexGeneration(row["embedding_model"], row["dimension"], row["chunking_strategy"]),
                row["ann_index_name"],
                row["created_at"],
            )
            for row in rows
        ]

    async def known_embeddings(
        self, tenant_id: str, generation: IndexGeneration, digests: Sequence[bytes]
    ) -> dict[bytes, npt.NDArray[np.float32]]:
        """Embeddings this tenant's index (same generation) already holds for these content
        digests: unchanged content of a new version is not embedded again. The slots asking
        at once share a query per tenant and generation (services/runtime/pg/coalesce.py)."""
        return await self._known.embeddings(tenant_id, generation, digests)

    def writer(
        self,
        lease: Lease,
        generation: IndexGeneration,
        chunks: Sequence[Chunk],
        embeddings: npt.NDArray[Any],
        *,
        search_generation_id: int | None = None,
    ) -> InTransaction:
        """The ``write(conn)`` to run inside ``queue.complete``'s fenced transaction, for
        search generation ``search_generation_id`` (None: none known)."""
        return VersionWrite(
            self,
            prepare_write(
                lease, generation, chunks, embeddings, search_generation_id=search_generation_id
            ),
        )

    async def write(self, conn: Transaction, prepared: ChunkWrite) -> None:
        """One version's write, in the completion's transaction after its fence held: the
        statements of a group's write, with one element each (together.py)."""
        await self._write_all(conn, [prepared])

    async def write_together(self, conn: Transaction, writes: Sequence[Any]) -> None:
        """The ``VersionWrite``s of a group, their fences held, in one set of statements
        (together.py)."""
        await self._write_all(conn, [write.prepared for write in writes])

    async def _write_all(self, conn: Transaction, writes: list[ChunkWrite]) -> None:
        await write_together(
            conn,
            writes,
            registry=self._registry,
            now=self._clock.now(),
            timeout_ms=self.write_timeout_ms,
        )

    # -- large documents: staged slice by slice, moved in by the fenced complete -----------

    async def stage(
        self,
        lease: Lease,
        generation: IndexGeneration,
        chunks: Sequence[Chunk],
        embeddings: npt.NDArray[Any],
        *,
        first: bool,
    ) -> None:
        """Stages one slice of a large document under the lease's fence (``LeaseLost`` when
        it no longer holds); nothing reaches the index before ``stream_writer``'s write."""
        records = await asyncio.to_thread(chunk_records, lease, generation, chunks, embeddings)
        await stage_slice(self._pool, self._clock, lease, records, first=first)

    async def discard_stream(self, lease: Lease) -> None:
        await discard_attempt(self._pool, lease)

    def stream_writer(
        self,
        lease: Lease,
        generation: IndexGeneration,
        chunk_count: int,
        *,
        search_generation_id: int | None = None,
    ) -> InTransaction:
        """The ``write(conn)`` for a staged document, run inside ``queue.complete``'s fenced
        transaction: the attempt's ``chunk_count`` staged chunks into the index, then the
        pointer and its event, as ``writer`` does for a document held in memory."""

        staged = ChunkWrite(
            lease, generation, [], search_generation_id=search_generation_id, staged=chunk_count
        )

        async def write(conn: Transaction) -> None:
            await self._write_all(conn, [staged])

        return write


async def ensure_ann_index(conn: Executor, generation: IndexGeneration, build_memory: str) -> None:
    """Build the model's HNSW index unless a valid one exists: the partitioned index, then
    each partition's part not yet built (an INVALID part, left by an interrupted build, is
    dropped and built again) and attached. Runs under the generation lock, outside any
    transaction (CREATE INDEX CONCURRENTLY cannot run in one); a crash half way leaves parts
    that the next worker's call keeps.

    An index built over existing rows (a rebuild after an interrupted build) crawls when its
    graph does not fit in maintenance_work_mem, as at the server's default for a large
    index (BENCHMARKS.md)."""
    name = generation.ann_index_name
    model = generation.embedding_model
    if await conn.fetchval(QUERIES["ann_index_state"], name) is True:
        return
    async with index_build_session(conn, build_memory):
        log.info("ann_index.building", index=name, model=model, dimension=generation.dimension)
        await conn.execute(create_parent_ann_index_sql(model, generation.dimension))
        partitions = [
            row["partition"] for row in await conn.fetch(QUERIES["knowledge_chunk_partitions"])
        ]
        for partition in partitions:
            await _ensure_partition_ann_index(conn, generation, partition)
        log.info("ann_index.built", index=name, model=model, partitions=len(partitions))


@contextlib.asynccontextmanager
async def index_build_session(conn: Executor, build_memory: str) -> AsyncIterator[None]:
    """The connection set up for an HNSW build, and back as it was afterwards: a long build
    must not hit the pool's statement_timeout, and crawls when its graph does not fit in
    maintenance_work_mem. Restored before release, as the indexer's pool does not reset
    sessions (runtime.pg.db.skip_session_reset)."""
    previous = await conn.fetchrow(QUERIES["start_index_build"], build_memory)
    assert previous is not None
    try:
        yield
    finally:
        await conn.fetchval(
            QUERIES["end_index_build"],
            previous["statement_timeout"],
            previous["maintenance_work_mem"],
        )


async def _ensure_partition_ann_index(
    conn: Executor, generation: IndexGeneration, partition: str
) -> None:
    model = generation.embedding_model
    part = partition_ann_index_name(model, partition)
    state = await conn.fetchrow(
        QUERIES["ann_partition_index_state"], part, generation.ann_index_name
    )
    if state is not None and not state["valid"]:
        log.warning("ann_index.invalid_dropped", index=part, model=model)
        await conn.execute(drop_partition_ann_index_sql(model, partition))
        state = None
    if state is None:
        await conn.execute(create_partition_ann_index_sql(model, generation.dimension, partition))
    if state is None or not state["attached"]:
        await conn.execute(attach_partition_ann_index_sql(model, partition))


@dataclasses.dataclass(frozen=True)
class PartitionedDrop:
    """DROP INDEX of a model's partitioned index takes knowledge_chunk's ACCESS EXCLUSIVE
    lock: queued behind a long transaction, it would hold up every search and completion
    queued behind it. So each of ``attempts`` tries gives up after a short ``lock_timeout``
    (a PostgreSQL duration) for any one lock, and after twice that in all (statement_timeout:
    the DROP takes each partition's lock in turn, holding the parent's meanwhile),
    ``pause_seconds`` apart."""

    lock_timeout: str = "2s"
    attempts: int = 5
    pause_seconds: float = 1.0

    async def run(self, conn: Executor, model: str, *, again: str) -> None:
        """Drops ``model``'s partitioned index; after the last try, DatabaseBusy (exit 1)
        telling the operator to run ``again`` (the command) once more."""
        name = ann_index_name(model)
        for attempt in range(self.attempts):
            try:
                async with conn.transaction():
                    await conn.fetchrow(QUERIES["set_local_drop_timeouts"], self.lock_timeout)
                    await conn.execute(drop_ann_index_sql(model))
                return
            except (asyncpg.LockNotAvailableError, asyncpg.QueryCanceledError):
                log.warning("ann_index.drop_waited", index=name, attempt=attempt + 1)
                if attempt + 1 < self.attempts:
                    await asyncio.sleep(self.pause_seconds)
        raise DatabaseBusy(
            f"index {name}: knowledge_chunk stayed locked by other transactions; "
            f"run `{again}` again"
        )
