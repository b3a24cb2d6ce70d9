"""The indexer's ports: the task queue, the transaction a sink writes through, the
document-version indexer, the source of stored versions and the gate a worker asks before
it claims.

Domain and worker code talk to these Protocols only; ``queue/store_pg.py`` (asyncpg) implements
``TaskQueue``, and so does the in-memory fake under ``tests/fakes/``; both pass one contract
suite (``tests/contract/``). No driver is imported here: the transaction handle a sink writes
through is the runtime's ``Transaction`` protocol.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

from services.embedding.guard.guard import ClaimAllowance as ClaimAllowance
from services.indexer.task import FailureDecision, IndexTask, Lease, RequeueRecord, TaskStatus
from services.runtime.pg.clock import Clock as Clock
from services.runtime.pg.clock import DatabaseClock as DatabaseClock
from services.runtime.pg.transaction import Transaction as Transaction

# Work run inside the fenced ``complete`` transaction, after the fence held (the task row is
# locked by then, so no takeover can slip in before commit): the sink writes chunks, the
# search pointer and its outbox event through the transaction it is given.
InTransaction = Callable[[Transaction], Awaitable[None]]


class WritableTogether(Protocol):
    """An ``InTransaction`` that can also go with others of its kind in one set of
    statements (services/indexer/sink/together.py): the queue's group commit hands the
    writes of a group to ``together`` of any one of them, once every fence of the group
    held; alone, or when a group's write fails, each runs as itself."""

    @property
    def lease(self) -> Lease: ...

    @property
    def together(self) -> Callable[[Transaction, Sequence[Any]], Awaitable[None]]: ...

    async def __call__(self, conn: Transaction) -> None: ...


def writable_together(write: object) -> WritableTogether | None:
    """``write`` when it is a ``WritableTogether``, else None. Told by its ``together``
    attribute, not ``isinstance``: against a runtime-checkable protocol that walks the
    protocol's members on every call, and it is asked for every completion."""
    return cast(WritableTogether, write) if getattr(write, "together", None) else None


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


class ClaimGate(Protocol):
    """Asked before each claim (services.indexer.queue.worker): while the embedding provider
    cannot take work (its breaker open, its quota paused) a worker claims nothing, so due
    tasks stay due and spend no attempt."""

    async def claim_allowance(self, owner: str) -> ClaimAllowance:
        """How many tasks ``owner`` may claim now (the embedding provider guard's answer:
        ``limit`` None = no limit, 0 = none, wait ``retry_in_seconds``; ``reason`` says why)."""
        ...


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
    # Retention removed the content (docs/architecture.md#document-lifecycle): ``content``
    # is empty and the version can never be indexed again.
    content_removed: bool = False


class VersionSource(Protocol):
    async def load(
        self, tenant_id: str, document_id: uuid.UUID, version_number: int
    ) -> StoredVersion | None:
        """The version of this tenant's document, or ``None`` if it does not exist."""
        ...
