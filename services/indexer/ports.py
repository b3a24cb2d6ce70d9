"""The indexer's ports: the task queue, the document-version indexer, the source of stored
versions and the clock.

Domain and worker code talk to these Protocols only; ``queue_pg`` (asyncpg) and
``queue_memory`` (a fake) implement ``TaskQueue`` and pass one contract suite
(``tests/contract/``).
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

from services.indexer.task import FailureDecision, IndexTask, Lease, RequeueRecord, TaskStatus

# Work run inside the fenced ``complete`` transaction, after the fence held (the task row is
# locked by then, so no takeover can slip in before commit). The argument is the adapter's
# transaction handle: an asyncpg connection for ``queue_pg``; the future pgvector sink
# writes chunks, the search pointer and its outbox event through it.
InTransaction = Callable[[Any], Awaitable[None]]


class Clock(Protocol):
    def now(self) -> datetime | None:
        """The time to use, or ``None`` for the database's own clock (production)."""
        ...


class DatabaseClock:
    """Production: every time-dependent query reads PostgreSQL's ``now()``."""

    def now(self) -> datetime | None:
        return None


class ManualClock:
    """Tests: a time that moves only when told, so lease expiry needs no sleeping."""

    def __init__(self, start: datetime | None = None) -> None:
        self._now = start or datetime.now(UTC)

    def now(self) -> datetime:
        return self._now

    def advance(self, seconds: float) -> datetime:
        self._now += timedelta(seconds=seconds)
        return self._now

    def set(self, when: datetime) -> None:
        self._now = when


class TaskQueue(Protocol):
    async def claim(
        self, tier: str, owner: str, *, lease_seconds: float, limit: int = 1
    ) -> list[Lease]:
        """Claim up to ``limit`` due tasks of ``tier`` (fair across tenants)."""
        ...

    async def heartbeat(self, lease: Lease, *, lease_seconds: float) -> Lease:
        """Extend a held lease; raises ``LeaseLost`` when the fence does not hold."""
        ...

    async def complete(self, lease: Lease, *, in_transaction: InTransaction | None = None) -> None:
        """Mark SUCCEEDED under the fence, running ``in_transaction`` in the same transaction;
        raises ``LeaseLost`` (and nothing is written) when the fence does not hold."""
        ...

    async def fail(self, lease: Lease, decision: FailureDecision) -> IndexTask:
        """Move to RETRY_WAIT or DEAD as decided; raises ``LeaseLost`` when fenced out."""
        ...

    async def get(self, task_id: uuid.UUID) -> IndexTask | None: ...

    async def list_tasks(
        self,
        *,
        status: TaskStatus | None = None,
        tenant_id: str | None = None,
        tier: str | None = None,
        limit: int = 100,
    ) -> list[IndexTask]: ...

    async def requeue(
        self, task_id: uuid.UUID, *, by: str, reset_attempts: bool, budget: int
    ) -> RequeueRecord:
        """Operator requeue of a DEAD task (``NotFound`` / ``InvalidTransition`` otherwise)."""
        ...

    async def requeue_history(self, task_id: uuid.UUID) -> list[RequeueRecord]:
        """Every requeue of the task, oldest first: who, when, budget before and after."""
        ...


@dataclass(frozen=True)
class IndexingOutcome:
    """A successful indexing run. ``write`` (if any) is run inside the fenced ``complete``
    transaction: the sink's chunks + search pointer + outbox event commit with SUCCEEDED
    or not at all."""

    write: InTransaction | None = None


class DocumentVersionIndexer(Protocol):
    async def index(self, lease: Lease) -> IndexingOutcome:
        """Do the slow work for one leased task. Raise ``IndexingFailed`` with a stable code
        on failure. Must hold no transaction or row lock while it works; it is cancelled
        when the lease is lost."""
        ...


@dataclass(frozen=True)
class StoredVersion:
    """An immutable document version as the publisher stored it."""

    media_type: str
    content: bytes
    sha256: bytes
    size_bytes: int


class VersionSource(Protocol):
    async def load(
        self, tenant_id: str, document_id: uuid.UUID, version_number: int
    ) -> StoredVersion | None:
        """The version of this tenant's document, or ``None`` if it does not exist."""
        ...
