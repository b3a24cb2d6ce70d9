"""Set-up for the tests of a finished task's completion (its group queue, its lease while it
waits and commits): writes of one uniform vector per chunk, an indexer that hands them back,
and two claimed tasks, the first's write held open in its group's transaction."""

from __future__ import annotations

import asyncio
import contextlib
import random
import uuid
from datetime import datetime
from typing import Any, NamedTuple

import asyncpg
import numpy as np

from services.index.generation import IndexGeneration
from services.indexer.ports import IndexingOutcome, InTransaction
from services.indexer.queue.attempt import TaskAttempts, WorkerEvent
from services.indexer.queue.store_pg import PgTaskQueue
from services.indexer.retry import RetryPolicy
from services.indexer.sink.pgvector import PgVectorSink
from services.indexer.task import Lease
from tests.support import versions
from tests.support.paused import PausedWrite
from tests.support.tasks import create_task

OWNER = "w1"


def uniform_write(sink: PgVectorSink, generation: IndexGeneration, lease: Lease) -> InTransaction:
    """The write of one chunk of the lease's version, its vector the same unit vector as all."""
    chunks = versions.make_chunks(
        lease.document_id,
        lease.version_number,
        [f"text of {lease.document_id}"],
        generation.chunking_strategy,
    )
    dimension = generation.dimension
    vectors = np.full((len(chunks), dimension), 1 / np.sqrt(dimension), dtype=np.float32)
    return sink.writer(lease, generation, chunks, vectors)


class Writes:
    """An indexer whose every task is done at once, its write the one given for it."""

    def __init__(self, writes: dict[uuid.UUID, InTransaction]) -> None:
        self.writes = writes

    async def index(self, lease: Lease) -> IndexingOutcome:
        return IndexingOutcome(write=self.writes[lease.task_id])


def attempts_of(
    queue: PgTaskQueue,
    writes: dict[uuid.UUID, InTransaction],
    events: asyncio.Queue[WorkerEvent],
    *,
    lease_seconds: float,
    **options: Any,
) -> TaskAttempts:
    """The attempts of worker ``OWNER``, each task done with its write, events queued."""
    return TaskAttempts(
        queue,
        Writes(writes),
        owner=OWNER,
        lease_seconds=lease_seconds,
        policy=RetryPolicy(),
        rng=random.Random(41),
        emit=events.put_nowait,
        **options,
    )


async def database_clock_passes(
    pool: asyncpg.Pool[Any], until: datetime, events: asyncio.Queue[WorkerEvent], tick: float
) -> None:
    """Returns once the database's clock is past ``until``: looked at after each worker
    event, or each ``tick`` without one (the lease's time passing is what is waited for)."""
    while not await pool.fetchval("SELECT now() > $1::timestamptz", until):
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(tick):
                await events.get()


class HeldAndQueued(NamedTuple):
    held: Lease  # its write paused in its group's transaction
    queued: Lease  # done at once, its completion queued behind the held one's group
    paused: PausedWrite
    events: asyncio.Queue[WorkerEvent]
    attempts: TaskAttempts


async def held_and_queued(
    pool: asyncpg.Pool[Any],
    queue: PgTaskQueue,
    generation: IndexGeneration,
    *,
    lease_seconds: float,
    **options: Any,
) -> HeldAndQueued:
    """Two new tasks claimed by ``OWNER``; ``options`` go to its TaskAttempts."""
    sink = PgVectorSink(pool)
    await sink.ensure_generation(generation)
    for _ in range(2):
        await create_task(pool)
    held, queued = await queue.claim("standard", OWNER, lease_seconds=lease_seconds, limit=2)
    paused = PausedWrite(uniform_write(sink, generation, held))
    events: asyncio.Queue[WorkerEvent] = asyncio.Queue()
    writes: dict[uuid.UUID, InTransaction] = {
        held.task_id: paused,
        queued.task_id: uniform_write(sink, generation, queued),
    }
    attempts = attempts_of(queue, writes, events, lease_seconds=lease_seconds, **options)
    return HeldAndQueued(held, queued, paused, events, attempts)
