"""The sink's path for large documents: slices staged under their attempt, moved into the
index by the fenced completion (migration 0013).

A document of many thousand chunks is not held whole in the indexer: as the pipeline
embeds each slice it writes it here, in a short transaction of its own that first takes
the task's fence (``lock_stream_lease``: the lease is this attempt's, and the task row is
held FOR SHARE until the slice commits). The index itself is untouched until the fenced
``complete``: there ``move_staged`` checks that every staged row is there, moves the
attempt's rows into ``knowledge_chunk`` and clears the task's staging rows, in the same
transaction as the search pointer, SUCCEEDED and the outbox event. A worker whose lease was
taken over therefore writes nothing to the index; its staged rows are never read, and go
when the task's next attempt starts staging or completes, or with the task when it ends
DEAD (queries.sql: the fenced ``fail_task`` and the lease-expiry burial in ``claim_tasks``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

import asyncpg
import numpy as np
import numpy.typing as npt
from pgvector import Vector

from services.indexer.ports import Clock
from services.indexer.sink.version import version_chunks
from services.indexer.task import Lease
from services.runtime.errors import KbError, LeaseLost
from services.runtime.pg.db import translate_db_errors
from services.runtime.pg.sql import queries_beside
from services.runtime.pg.transaction import Transaction

if TYPE_CHECKING:
    from services.index.generation import IndexGeneration
    from services.indexer.chunk import Chunk

QUERIES = queries_beside(__file__, "sink.sql")

STREAM_TABLE: Final = "knowledge_chunk_stream"
# The columns of chunk_records' records, in their order.
CHUNK_RECORD_COLUMNS: Final = (
    "chunk_id",
    "ordinal",
    "heading_path",
    "text",
    "content_digest",
    "embedding",
)
STREAM_COLUMNS: Final = ("task_id", "lease_attempt", *CHUNK_RECORD_COLUMNS)


class StagedChunksMissing(KbError):
    """The completion found fewer staged chunks than the attempt wrote (the staging table
    is UNLOGGED: a database crash empties it). Retriable: the next attempt streams again."""

    code = "INDEX_STAGING_INCOMPLETE"
    retriable = True


def chunk_records(
    lease: Lease,
    generation: IndexGeneration,
    chunks: Sequence[Chunk],
    embeddings: npt.NDArray[Any],
) -> list[tuple[Any, ...]]:
    """The COPY records of ``chunks`` (chunk_id, ordinal, heading_path, text, digest,
    embedding), after checking the embeddings against the chunks and the generation."""
    if not chunks:
        raise ValueError(f"task {lease.task_id}: no chunks to write")
    if embeddings.shape != (len(chunks), generation.dimension):
        raise ValueError(
            f"task {lease.task_id}: embeddings of shape {embeddings.shape} for "
            f"{len(chunks)} chunks of dimension {generation.dimension}"
        )
    vectors = np.ascontiguousarray(embeddings, dtype=np.float32)
    if not np.isfinite(vectors).all():
        raise ValueError(f"task {lease.task_id}: embeddings hold NaN or infinity")
    return [
        (
            chunk.chunk_id,
            chunk.ordinal,
            list(chunk.heading_path),
            chunk.text,
            chunk.content_digest,
            Vector(vectors[row]),
        )
        for row, chunk in enumerate(chunks)
    ]


async def stage_slice(
    pool: asyncpg.Pool[Any],
    clock: Clock,
    lease: Lease,
    records: list[tuple[Any, ...]],
    *,
    first: bool,
) -> None:
    """Writes one slice's records under the lease's fence; raises ``LeaseLost`` (and writes
    nothing) when the lease is no longer this attempt's. The first slice of an attempt
    also deletes what earlier attempts of the task left behind."""
    prefix = (lease.task_id, lease.lease_attempt)
    with translate_db_errors():
        async with pool.acquire() as conn, conn.transaction():
            held = await conn.fetchval(
                QUERIES["lock_stream_lease"],
                lease.task_id,
                lease.owner,
                lease.lease_attempt,
                clock.now(),
            )
            if held is None:
                raise LeaseLost(
                    f"task {lease.task_id} lease {lease.lease_attempt} of {lease.owner} lost "
                    "while staging its chunks"
                )
            if first:
                await conn.execute(QUERIES["delete_stale_stream"], *prefix)
            await conn.copy_records_to_table(
                STREAM_TABLE,
                records=[prefix + record for record in records],
                columns=STREAM_COLUMNS,
            )


async def discard_attempt(pool: asyncpg.Pool[Any], lease: Lease) -> None:
    """Deletes the rows this attempt staged (it failed; a retry streams again)."""
    with translate_db_errors():
        await pool.execute(QUERIES["delete_attempt_stream"], lease.task_id, lease.lease_attempt)


async def move_staged(
    conn: Transaction,
    lease: Lease,
    generation: IndexGeneration,
    chunk_count: int,
    replaced: str | None,
) -> str:
    """Inside the fenced complete, under the pointer's lock: the attempt's staged chunks
    into the index, in place of the version's earlier set of this generation and of the
    served set ``replaced`` (sink.sql: replace_version_chunks), the task's staging rows
    gone. Raises ``StagedChunksMissing`` (the transaction then rolls back) unless exactly
    ``chunk_count`` rows are staged. Returns the replacing DELETE's status."""
    with translate_db_errors():
        staged = await conn.fetchval(QUERIES["count_stream"], lease.task_id, lease.lease_attempt)
        if staged != chunk_count:
            raise StagedChunksMissing(
                f"task {lease.task_id} attempt {lease.lease_attempt} staged {chunk_count} "
                f"chunks, {staged} found at completion"
            )
        status: str = await conn.execute(
            QUERIES["replace_streamed_version_chunks"],
            *version_chunks(lease, generation),
            replaced,
            lease.task_id,
            lease.lease_attempt,
        )
        await conn.execute(
            QUERIES["move_streamed_chunks"],
            lease.task_id,
            lease.lease_attempt,
            *version_chunks(lease, generation),
            generation.dimension,
        )
    return status
