"""The index task as every service sees it: its states, its type names, its row, and the
library call that creates one.

The publisher creates tasks (in its publish transaction, beside the outbox event), the
indexer claims and finishes them, operators read them: one definition of the row for all.
The state machine itself (which transitions exist, the retry policy) is the indexer's.
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Final, NamedTuple, TypeVar

from services.runtime.pg.db import translate_db_errors
from services.runtime.pg.records import Row, from_row
from services.runtime.pg.sql import queries_beside
from services.runtime.pg.transaction import Transaction

_QUERIES = queries_beside(__file__, "tasks.sql")

TASK_TYPE_INDEX_VERSION: Final = "INDEX_VERSION"


class TaskStatus(enum.StrEnum):
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    RETRY_WAIT = "RETRY_WAIT"
    SUCCEEDED = "SUCCEEDED"
    DEAD = "DEAD"


@dataclass(frozen=True)
class NewIndexTask:
    """What a task is created with: its id, its business key (tenant, document, version,
    type) and the tier whose workers run it."""

    task_id: uuid.UUID
    tenant_id: str
    document_id: uuid.UUID
    version_number: int
    task_type: str
    tier: str


@dataclass(frozen=True)
class TaskProgress:
    """Where a task stands: its state, its attempts, its error and its times. Every reader
    of a task sees these, its tenant too (the publisher's ``TenantTaskView``)."""

    status: TaskStatus
    attempts: int
    max_attempts: int
    lease_until: datetime | None
    next_attempt_at: datetime
    error_code: str | None
    error_message: str | None
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None


@dataclass(frozen=True)
class IndexTaskRecord(TaskProgress, NewIndexTask):
    """One ``index_task`` row (docs/architecture.md#tables), column for column: its key
    (``NewIndexTask``), where it stands (``TaskProgress``) and who holds its lease."""

    lease_owner: str | None


# The select list of a whole row, in field order (queries may alias columns to these names).
INDEX_TASK_COLUMNS: Final = ", ".join(f.name for f in fields(IndexTaskRecord))

# The column default of index_task.max_attempts (migration 0001).
DEFAULT_MAX_ATTEMPTS: Final = 8


TaskRecord = TypeVar("TaskRecord", bound=IndexTaskRecord)


def task_of_row(record: type[TaskRecord], row: Row) -> TaskRecord:
    """A row holding every column as ``record``, ``status`` typed: the record itself or a
    subclass that adds behaviour (the indexer's ``IndexTask``)."""
    return from_row(record, row, status=TaskStatus(row["status"]))


def index_task_from_row(row: Row) -> IndexTaskRecord:
    return task_of_row(IndexTaskRecord, row)


class EnqueuedTask(NamedTuple):
    task_id: uuid.UUID
    created: bool  # False: the business key existed; ``task_id`` is the existing task's


async def enqueue_index_task(
    conn: Transaction,
    *,
    tenant_id: str,
    document_id: uuid.UUID,
    version_number: int,
    tier: str,
    task_type: str = TASK_TYPE_INDEX_VERSION,
    task_id: uuid.UUID | None = None,
    max_attempts: int = DEFAULT_MAX_ATTEMPTS,
    now: datetime | None = None,
) -> EnqueuedTask:
    """Create the PENDING task of (tenant, document, version, type) unless it exists, in the
    caller's transaction; return its id and whether this call created it.

    Idempotent on the business key: a repeated publish gets the first task's id. Two
    statements on purpose: a concurrent insert of the same key makes ours wait for its
    commit and then insert nothing, and only a new statement (a new snapshot under READ
    COMMITTED) sees the row it committed."""
    new_id = task_id or uuid.uuid4()
    with translate_db_errors():
        created = await conn.fetchval(
            _QUERIES["insert_index_task"],
            new_id,
            tenant_id,
            document_id,
            version_number,
            task_type,
            tier,
            max_attempts,
            now,
        )
        if created is not None:
            return EnqueuedTask(created, True)
    existing = await find_index_task(conn, tenant_id, document_id, version_number, task_type)
    if existing is None:
        # The conflicting insert rolled back between our two statements: try again.
        return await enqueue_index_task(
            conn,
            tenant_id=tenant_id,
            document_id=document_id,
            version_number=version_number,
            tier=tier,
            task_type=task_type,
            task_id=new_id,
            max_attempts=max_attempts,
            now=now,
        )
    return EnqueuedTask(existing, False)


async def enqueue_generation_tasks(
    conn: Transaction,
    *,
    tenant_id: str,
    tier: str,
    versions: Sequence[tuple[uuid.UUID, int]],
    task_type: str = TASK_TYPE_INDEX_VERSION,
    max_attempts: int = DEFAULT_MAX_ATTEMPTS,
    now: datetime | None = None,
) -> list[uuid.UUID]:
    """The dual write of a publish, in its transaction: for each published (document,
    version), one task per generation the tenant is built in beside its serving one
    (docs/architecture.md#index-generations); the ids of the tasks created. Takes the
    shared advisory lock that `kb index generations create` takes exclusively, so a
    generation created meanwhile is either seen here or backfills this version."""
    if not versions:
        return []
    with translate_db_errors():
        await conn.fetchval(_QUERIES["lock_search_generations_shared"])
        rows = await conn.fetch(
            _QUERIES["insert_generation_tasks"],
            tenant_id,
            tier,
            [document_id for document_id, _ in versions],
            [version_number for _, version_number in versions],
            task_type,
            max_attempts,
            now,
        )
    return [row["task_id"] for row in rows]


async def find_index_task(
    conn: Transaction,
    tenant_id: str,
    document_id: uuid.UUID,
    version_number: int,
    task_type: str = TASK_TYPE_INDEX_VERSION,
) -> uuid.UUID | None:
    """The id of the task of (tenant, document, version, type) that builds the tenant's
    serving generation (the one a publish enqueues), if there is one."""
    with translate_db_errors():
        task_id: uuid.UUID | None = await conn.fetchval(
            _QUERIES["find_index_task"], tenant_id, document_id, version_number, task_type
        )
    return task_id
