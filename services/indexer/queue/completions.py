"""Group commit for the fenced completions of several tasks: one short transaction; when a
task's write fails, the group again with each task's fence and write in a savepoint of its
own.

A completion is a small transaction (the fenced UPDATE, the chunks, the pointer, an outbox
event), and its COMMIT -- a WAL flush, a round trip -- costs as much as everything in it for
a short document. While a group commits, the completions that arrive wait and then go
together as the next group, so under load a commit serves many tasks and at low load a
completion is never delayed by a timer. Up to ``committing_groups`` groups commit at once,
each on a connection of its own: one group's statements keep one database backend busy
while the next group waits behind it, and with a second committing meanwhile the database
works on both.

Each task keeps its own outcome. A fence that no longer holds (the lease was lost) changes
nothing, so that task's write is skipped and it gets ``LeaseLost``; the others commit. A
write that fails is rare (a timeout, a constraint): the group's transaction is rolled back
and the group runs again with a savepoint per task, whose failure rolls back that task's
rows only; it gets its own error, the other tasks commit. Savepoints cost two round trips a
task, which for a short document is a good share of its completion, so they are paid only
then. The group's transaction may have held its rows longer than a lease before it failed
(heartbeats skip a row it holds, see below): the fallback first renews the leases of the
tasks whose fence held in it (``renew``, fenced by owner and generation, which no takeover
can have passed), so a slow failure does not cost the others their lease. A
COMMIT that fails, or a connection lost mid-group, fails every task not failed already with
that error: the caller reads each task's row back to learn whether the COMMIT landed, as
for a completion of its own.

A group whose writes all can go together (``WritableTogether``: the sink's in-memory writes)
is written in one set of statements: every fence in one statement (``complete_task`` for all), then
the writes of the tasks whose fence held in one statement per kind (the sink's
together.py), a dozen statements for the group instead of a dozen a task. Otherwise, or
when that fails, as above: one task after the other.

A completion keeps its task's lease until it returns (attempt.py heartbeats on while it
waits here): ``fenced`` tells the queue's heartbeat that this process's own open group
transaction holds the task's row (its fence passed; no takeover can come before it ends, and
a beat would only wait for it), and ``withdraw`` drops a completion still waiting whose
lease a heartbeat found lost. That keeping is bounded by ``max_wait_seconds``: the attempt
stops beating after it, and a completion still waiting for a group by then is withdrawn
(``LeaseLost``: its lease is left to lapse and another worker does the task again); a group
that finds no connection within it fails its tasks (``DatabaseBusy``, nothing written)
instead of waiting on, its pool starved. One already committing gets its fence's answer.

A group holds at most one completion per document (a second waits for the next group), and
its tasks are written in (tenant, document, version) order: the task rows (complete_task
locks them in this order, and so does `kb index generations retire`), the pointer rows and
the outbox's per-document advisory locks are taken in one order by every group, so two groups
committing at once (of this process or another) wait for each other instead of
deadlocking. Two versions of one document in two groups committing at once are written
one after the other (the second waits for the first's pointer lock), and the pointer only
ever moves forward, whichever commits first.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import asyncpg

from services.indexer.ports import InTransaction, writable_together
from services.indexer.task import Lease
from services.runtime.errors import DatabaseBusy, LeaseLost
from services.runtime.logging import get_logger
from services.runtime.pg.db import translate_db_errors
from services.runtime.pg.transaction import Transaction
from services.runtime.tracing.spans import batch_span

# The fenced UPDATE of one task, in the group's transaction: False when the fence refused it.
Fence = Callable[[Transaction, Lease], Awaitable[bool]]
# The fenced UPDATE of several tasks in one statement: the ids of those whose fence held.
FenceAll = Callable[[Transaction, Sequence[Lease]], Awaitable[set[uuid.UUID]]]
# Locks the group's rows still ours and renews the leases of those given (their fence held
# in a group transaction rolled back since): the ids of the rows it locked.
Renew = Callable[[Transaction, Sequence[Lease], set[uuid.UUID]], Awaitable[set[uuid.UUID]]]
LostLease = Callable[[Lease], Exception]
PooledConnection: TypeAlias = "asyncpg.pool.PoolConnectionProxy[Any]"

log = get_logger(__name__)


@dataclass(eq=False)
class _Completion:
    lease: Lease
    write: InTransaction
    done: asyncio.Future[None]
    error: BaseException | None = field(default=None)
    taken: bool = False  # in a group: no longer withdrawn
    fenced: bool = False  # its fence held in a group transaction still open

    @property
    def order(self) -> tuple[str, str, int]:
        lease = self.lease
        return (lease.tenant_id, str(lease.document_id), lease.version_number)


class GroupCommitter:
    """Runs the completions handed to ``complete`` in groups of at most ``max_group``, at
    most ``committing_groups`` groups at a time."""

    def __init__(
        self,
        pool: asyncpg.Pool[Any],
        fence: Fence,
        lost: LostLease,
        *,
        max_group: int = 32,
        on_group: Callable[[int], None] | None = None,
        fence_all: FenceAll | None = None,
        committing_groups: int = 1,
        renew: Renew | None = None,
        max_wait_seconds: float | None = None,
    ) -> None:
        if max_group < 1:
            raise ValueError("max_group must be >= 1")
        if committing_groups < 1:
            raise ValueError("committing_groups must be >= 1")
        self._pool = pool
        self._fence = fence
        self._fence_all = fence_all
        self._renew = renew
        self.max_wait_seconds = max_wait_seconds
        # Groups written as one set of statements (for tests and the bench's report).
        self.written_as_set = 0
        self._lost = lost
        self.max_group = max_group
        self._on_group = on_group
        self._queue: deque[_Completion] = deque()
        self._committing_groups = committing_groups
        self._committers: set[asyncio.Task[None]] = set()
        # The completions not returned yet, by lease (task, generation).
        self._pending: dict[tuple[uuid.UUID, int], _Completion] = {}

    async def complete(self, lease: Lease, write: InTransaction) -> None:
        """Returns once the task's completion committed; raises what kept it from it."""
        completion = _Completion(lease, write, asyncio.get_running_loop().create_future())
        key = _key(lease)
        self._pending[key] = completion
        self._queue.append(completion)
        overdue = None
        if self.max_wait_seconds is not None:
            overdue = asyncio.get_running_loop().call_later(
                self.max_wait_seconds, self._withdraw_overdue, completion
            )
        # done(), not a done-callback: a committer that has just found the queue empty is
        # done at once, but its callbacks run a turn later, and a completion queued meanwhile
        # must not count on it.
        self._committers = {committer for committer in self._committers if not committer.done()}
        if len(self._committers) < self._committing_groups:
            self._committers.add(asyncio.create_task(self._commit_groups()))
        try:
            await completion.done
        finally:
            if overdue is not None:
                overdue.cancel()
            if self._pending.get(key) is completion:
                del self._pending[key]

    def fenced(self, lease: Lease) -> bool:
        """Whether the lease's completion passed its fence in a group transaction still
        open: the task's row is locked by it until it ends."""
        completion = self._pending.get(_key(lease))
        return completion is not None and completion.fenced

    def withdraw(self, lease: Lease, error: Exception) -> bool:
        """Fails the lease's completion with ``error`` if it still waits for a group (its
        lease is lost: its fence would refuse it); whether it did. One already in a group
        gets its fence's answer."""
        completion = self._pending.get(_key(lease))
        if completion is None or completion.taken or completion.done.done():
            return False
        completion.done.set_exception(error)
        return True

    def _withdraw_overdue(self, completion: _Completion) -> None:
        lease = completion.lease
        error = LeaseLost(
            f"task {lease.task_id}: completion waited {self.max_wait_seconds}s for a group;"
            " withdrawn, its lease left to lapse"
        )
        if self.withdraw(lease, error):
            log.warning(
                "completion.withdrawn",
                task_id=str(lease.task_id),
                lease_attempt=lease.lease_attempt,
                reason="max_wait",
                max_wait_seconds=self.max_wait_seconds,
            )

    async def _commit_groups(self) -> None:
        while self._queue:
            group = self._take_group()
            if not group:
                continue
            if self._on_group is not None:
                self._on_group(len(group))
            try:
                await self._commit(group)
            except BaseException as error:
                for completion in group:
                    if completion.error is None:
                        completion.error = error
                if not isinstance(error, Exception):
                    self._settle(group)
                    raise
            self._settle(group)

    def _take_group(self) -> list[_Completion]:
        """The next group, in write order: at most ``max_group`` completions, one per
        document (a later completion of a document already in it stays first in line)."""
        group: list[_Completion] = []
        documents: set[tuple[str, uuid.UUID]] = set()
        later: list[_Completion] = []
        while self._queue and len(group) < self.max_group:
            completion = self._queue.popleft()
            if completion.done.done():
                # A caller that went away (cancelled at shutdown) is not written: its lease
                # expires and the task is done again, as when cancelled before completing.
                continue
            document = (completion.lease.tenant_id, completion.lease.document_id)
            if document in documents:
                later.append(completion)
                continue
            documents.add(document)
            completion.taken = True
            group.append(completion)
        self._queue.extendleft(reversed(later))
        return sorted(group, key=lambda c: c.order)

    async def _commit(self, group: list[_Completion]) -> None:
        # One span for the group's transaction, in one of its tasks' traces; each task's
        # switch span links to it (sink/together.py). Each task's own outcome is on its
        # attempt's span.
        with batch_span(
            "kb.index.group_commit",
            [c.lease.traceparent for c in group],
            {
                "db.system.name": "postgresql",
                "db.operation.name": "COMMIT",
                "db.operation.batch.size": len(group),
            },
        ):
            try:
                await self._commit_group(group)
            finally:
                _unfence(group)  # its transaction is over, committed or not

    @contextlib.asynccontextmanager
    async def _connection(self) -> AsyncIterator[PooledConnection]:
        """A connection of the pool, waited for at most ``max_wait_seconds``: a starved pool
        fails the group (nothing was sent) rather than holding its tasks' leases on."""
        try:
            conn = await self._pool.acquire(timeout=self.max_wait_seconds)
        except TimeoutError as error:
            raise DatabaseBusy(
                f"no connection for a completion group within {self.max_wait_seconds}s"
            ) from error
        try:
            yield conn
        finally:
            await self._pool.release(conn)

    async def _commit_group(self, group: list[_Completion]) -> None:
        with translate_db_errors():
            async with self._connection() as conn:
                if len(group) == 1:
                    # Alone, the transaction is the task's own: no savepoint needed.
                    async with conn.transaction():
                        await self._fenced_write(conn, group[0])
                    return
                try:
                    if self._fence_all is not None and _writable_together(group):
                        await self._commit_as_set(conn, group, self._fence_all)
                        self.written_as_set += 1
                    else:
                        await self._commit_together(conn, group)
                    return
                except Exception:
                    if conn.is_closed():
                        raise
                # One write failed and took the group's transaction with it: nothing of the
                # group was written. Again, each task in a savepoint of its own, so the failure
                # stays with its task.
                held = {c.lease.task_id for c in group if c.fenced}
                _unfence(group)
                for completion in group:
                    completion.error = None
                await self._commit_isolated(conn, group, held)

    async def _commit_together(self, conn: PooledConnection, group: list[_Completion]) -> None:
        """The group in one transaction without savepoints (two statements a task fewer): a
        lost lease needs none, since its fenced UPDATE changed nothing and the task's write
        is skipped; any other error ends the transaction, and the caller runs the group again
        with a savepoint per task."""
        async with conn.transaction():
            for completion in group:
                if await self._fence(conn, completion.lease):
                    completion.fenced = True
                    await completion.write(conn)
                else:
                    completion.error = self._lost(completion.lease)

    async def _commit_as_set(
        self, conn: PooledConnection, group: list[_Completion], fence_all: FenceAll
    ) -> None:
        """The group in one transaction and one set of statements: every fence at once, then
        the writes of the tasks whose fence held, together. A lost lease writes nothing; any
        other error ends the transaction, and the caller runs the group again task by task."""
        async with conn.transaction():
            held = await fence_all(conn, [completion.lease for completion in group])
            writes = []
            for completion in group:
                if completion.lease.task_id in held:
                    completion.fenced = True
                    writes.append(completion.write)
                else:
                    completion.error = self._lost(completion.lease)
            if writes:
                first = writable_together(writes[0])
                assert first is not None
                await first.together(conn, writes)

    async def _commit_isolated(
        self, conn: PooledConnection, group: list[_Completion], held: set[uuid.UUID]
    ) -> None:
        """The group again, each task in a savepoint of its own. ``held``: the tasks whose
        fence held in the transaction that failed, their leases renewed first."""
        async with conn.transaction():
            locked: set[uuid.UUID] = set()
            if held and self._renew is not None:
                with translate_db_errors():
                    locked = await self._renew(conn, [c.lease for c in group], held)
                for completion in group:
                    # Rows this transaction holds: heartbeats leave them alone again.
                    completion.fenced = completion.lease.task_id in locked
            for completion in group:
                try:
                    with translate_db_errors():
                        # A savepoint: rolled back alone when this task's fence or write
                        # fails, with whatever it wrote and locked.
                        async with conn.transaction():
                            await self._fenced_write(conn, completion)
                except Exception as error:
                    completion.error = error
                    # Its savepoint, row lock included, is gone, unless the renewal took the
                    # row before it.
                    completion.fenced = completion.lease.task_id in locked
                    if conn.is_closed():
                        raise

    async def _fenced_write(self, conn: Transaction, completion: _Completion) -> None:
        if not await self._fence(conn, completion.lease):
            raise self._lost(completion.lease)
        completion.fenced = True
        await completion.write(conn)

    @staticmethod
    def _settle(group: list[_Completion]) -> None:
        for completion in group:
            if completion.done.done():
                continue
            if completion.error is None:
                completion.done.set_result(None)
            elif isinstance(completion.error, Exception):
                completion.done.set_exception(completion.error)
            else:
                completion.done.cancel()


def _key(lease: Lease) -> tuple[uuid.UUID, int]:
    return (lease.task_id, lease.lease_attempt)


def _unfence(group: list[_Completion]) -> None:
    for completion in group:
        completion.fenced = False


def _writable_together(group: list[_Completion]) -> bool:
    """Whether every write of ``group`` can go in one set, through one sink."""
    first = writable_together(group[0].write)
    if first is None:
        return False
    together = first.together
    return all(
        (other := writable_together(completion.write)) is not None and other.together == together
        for completion in group[1:]
    )
