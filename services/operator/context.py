"""What the operator routes work with, built once per app from a pool and the settings.

The page reads through its own store, requeues through the indexer's audited task queue
(the same path as `kb tasks requeue`), and asks the relay's outbox source for the backlog,
so its numbers are the ones those services compute.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import asyncpg

from services.indexer.gc.settings import RetentionSettings
from services.indexer.queue.store_pg import PgTaskQueue
from services.operator.settings import OperatorSettings
from services.operator.store_pg import PgOperatorStore
from services.relay.outbox_pg import PgOutboxSource


@dataclass(frozen=True)
class Backlog:
    rows: int | None  # None: unknown (a partition's progress belongs to another cluster)
    oldest_age_seconds: float | None


Requeue = Callable[[uuid.UUID, str], Awaitable[Any]]


@dataclass(frozen=True)
class OperatorContext:
    settings: OperatorSettings
    store: PgOperatorStore
    requeue: Requeue
    backlog: Callable[[], Awaitable[Backlog]]
    # KB_RETENTION_SUPERSEDED_DAYS as this process reads it: what the lifecycle page calls
    # due (the indexers' own setting decides what is removed).
    retention_days: int = RetentionSettings.model_fields["superseded_days"].default


def build_operator_context(pool: asyncpg.Pool[Any], settings: OperatorSettings) -> OperatorContext:
    queue = PgTaskQueue(pool)
    outbox = PgOutboxSource(pool)

    async def requeue(task_id: uuid.UUID, by: str) -> Any:
        return await queue.requeue(
            task_id, by=by, reset_attempts=True, budget=settings.indexer_max_attempts
        )

    async def backlog() -> Backlog:
        found = await outbox.backlog()
        if found.refused_partitions:
            return Backlog(None, None)
        return Backlog(found.rows, found.oldest_age_s)

    return OperatorContext(
        settings,
        PgOperatorStore(pool),
        requeue,
        backlog,
        retention_days=RetentionSettings().superseded_days,
    )
