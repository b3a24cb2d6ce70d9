"""A task that ends DEAD writes ``DocumentIndexingFailed`` in the transaction that buries it,
once per ending, naming the ingest command that published the version
(docs/architecture.md#events)."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime
from typing import Any

import asyncpg
import pytest

from services.indexer.queue.store_pg import PgTaskQueue
from services.indexer.queue.worker import RunOnceResult, Worker
from services.indexer.retry import RetryPolicy
from services.indexer.task import FailureDecision, TaskStatus
from services.publisher.domain import Publisher
from services.publisher.ingest.apply import IngestApplier
from services.publisher.ingest.commands import decode_command
from services.publisher.ingest.ports import CommandAnswer
from services.publisher.ingest.store_pg import PgIngestStore
from services.runtime.erasure.erase_pg import PgErasureStore
from services.runtime.errors import LeaseLost
from services.runtime.messaging.avro import default_registry
from tests.support.api import add_tenant
from tests.support.clock import ManualClock
from tests.support.ingest import publish_command
from tests.support.pipeline import running_pipeline
from tests.support.tasks import create_task

pytestmark = pytest.mark.integration

LEASE = 30.0
FAILED = "DocumentIndexingFailed"
# An error message that quotes content: it must never reach the event.
SECRET = "could not parse 'the merger closes on friday'"


def _dead(code: str = "DOCUMENT_PARSE_FAILED") -> FailureDecision:
    return FailureDecision(TaskStatus.DEAD, code, SECRET, 0.0)


async def _failed(conn: asyncpg.Connection[Any]) -> list[dict[str, Any]]:
    rows = await conn.fetch(
        "SELECT event_id, payload FROM outbox WHERE event_type = $1 ORDER BY position", FAILED
    )
    for row in rows:
        assert SECRET.encode() not in bytes(row["payload"])
    decoded = [default_registry().decode(bytes(r["payload"])).record for r in rows]
    assert [d["eventId"] for d in decoded] == [r["event_id"] for r in rows]
    return decoded


async def _published_by_command(pool: asyncpg.Pool[Any], payload: bytes) -> CommandAnswer:
    """The answer of a publish command applied as `kb ingest run` applies it."""
    store = PgIngestStore(pool)
    publisher = Publisher(store, max_upload_bytes=1 << 20, erasure=PgErasureStore(pool))
    applier = IngestApplier(publisher, store, max_upload_bytes=1 << 20)
    return await applier.apply(decode_command(payload, max_inline_bytes=1 << 20))


async def test_a_terminal_failure_names_its_code_and_the_publishing_command(
    pool: asyncpg.Pool[Any], conn: asyncpg.Connection[Any]
) -> None:
    tenant = (await add_tenant(conn, "acme")).tenant_id
    command_id = uuid.uuid4()
    answer = await _published_by_command(
        pool, publish_command(tenant, "page-1", command_id=command_id)
    )
    queue = PgTaskQueue(pool)
    [lease] = await queue.claim("standard", "w1", lease_seconds=LEASE)
    assert lease.task_id == answer.task_id

    ended = await queue.fail(lease, _dead())
    assert ended.status is TaskStatus.DEAD
    # A redelivered failure of the same lease is fenced out and adds nothing.
    with pytest.raises(LeaseLost):
        await queue.fail(lease, _dead())

    [event] = await _failed(conn)
    assert event == {
        "eventId": event["eventId"],
        "tenantId": tenant,
        "tier": "standard",
        "documentId": answer.document_id,
        "versionNumber": 1,
        "taskId": answer.task_id,
        "errorCode": "DOCUMENT_PARSE_FAILED",
        "commandId": command_id,
        "occurredAt": ended.finished_at,
    }


async def test_success_and_a_retry_write_no_failure(
    pool: asyncpg.Pool[Any], conn: asyncpg.Connection[Any]
) -> None:
    await create_task(pool)
    await create_task(pool)
    queue = PgTaskQueue(pool)
    first, second = await queue.claim("standard", "w1", lease_seconds=LEASE, limit=2)
    await queue.complete(first)
    retried = await queue.fail(
        second, FailureDecision(TaskStatus.RETRY_WAIT, "EMBEDDING_TIMEOUT", SECRET, 1.0)
    )
    assert retried.status is TaskStatus.RETRY_WAIT
    assert await _failed(conn) == []


async def test_a_spent_provider_budget_is_announced_when_the_fail_turns_it_dead(
    pool: asyncpg.Pool[Any], conn: asyncpg.Connection[Any]
) -> None:
    clock = ManualClock(datetime.now(UTC))
    created = await create_task(pool, next_attempt_at=clock.now())
    queue = PgTaskQueue(pool, clock=clock)
    provider = FailureDecision(
        TaskStatus.RETRY_WAIT,
        "EMBEDDING_UNAVAILABLE",
        SECRET,
        1.0,
        provider_budget_seconds=10.0,
        budget_spent_message="budget spent",
    )
    [lease] = await queue.claim("standard", "w1", lease_seconds=LEASE)
    assert (await queue.fail(lease, provider)).status is TaskStatus.RETRY_WAIT
    clock.advance(11)
    [lease] = await queue.claim("standard", "w1", lease_seconds=LEASE)
    assert (await queue.fail(lease, provider)).status is TaskStatus.DEAD
    [event] = await _failed(conn)
    assert (event["taskId"], event["errorCode"]) == (created.task_id, "EMBEDDING_UNAVAILABLE")
    assert event["commandId"] is None


async def test_an_exhausted_lease_is_announced_once_by_the_claim_that_buries_it(
    pool: asyncpg.Pool[Any], conn: asyncpg.Connection[Any]
) -> None:
    clock = ManualClock(datetime.now(UTC))
    created = await create_task(pool, max_attempts=1, next_attempt_at=clock.now())
    queue = PgTaskQueue(pool, clock=clock)
    [lease] = await queue.claim("standard", "w1", lease_seconds=LEASE)
    clock.advance(LEASE + 1)
    assert await queue.claim("standard", "w2", lease_seconds=LEASE) == []
    assert await queue.claim("standard", "w3", lease_seconds=LEASE) == []
    buried = await queue.get(created.task_id)
    assert buried is not None
    assert buried.status is TaskStatus.DEAD

    [event] = await _failed(conn)
    assert event["taskId"] == created.task_id
    assert event["documentId"] == created.document_id
    assert event["errorCode"] == "LEASE_ATTEMPTS_EXHAUSTED"
    assert event["commandId"] is None
    assert event["occurredAt"] == buried.finished_at
    with pytest.raises(LeaseLost):
        await queue.fail(lease, _dead())
    assert len(await _failed(conn)) == 1


async def test_claimers_racing_over_an_exhausted_lease_announce_it_once_and_still_claim(
    pool: asyncpg.Pool[Any], conn: asyncpg.Connection[Any]
) -> None:
    clock = ManualClock(datetime.now(UTC))
    exhausted = await create_task(pool, max_attempts=1, next_attempt_at=clock.now())
    queue = PgTaskQueue(pool, clock=clock)
    await queue.claim("standard", "w0", lease_seconds=LEASE)
    clock.advance(LEASE + 1)
    due = [
        await create_task(pool, tenant_id=f"t{i}", next_attempt_at=clock.now()) for i in range(4)
    ]
    queues = [PgTaskQueue(pool, clock=clock) for _ in range(4)]
    claimed = await asyncio.gather(
        *(q.claim("standard", f"w{i}", lease_seconds=LEASE) for i, q in enumerate(queues))
    )
    # Every claimer that found the exhausted task tried to bury it; one did.
    assert sorted(str(lease.task_id) for leases in claimed for lease in leases) == sorted(
        str(task.task_id) for task in due
    )
    [event] = await _failed(conn)
    assert event["taskId"] == exhausted.task_id


async def test_each_ending_of_a_requeued_task_is_an_event_of_its_own(
    pool: asyncpg.Pool[Any], conn: asyncpg.Connection[Any]
) -> None:
    created = await create_task(pool)
    queue = PgTaskQueue(pool)
    [lease] = await queue.claim("standard", "w1", lease_seconds=LEASE)
    await queue.fail(lease, _dead())
    await queue.requeue(created.task_id, by="ops", reset_attempts=False, budget=1)
    [lease] = await queue.claim("standard", "w1", lease_seconds=LEASE)
    await queue.fail(lease, _dead("DOCUMENT_EMPTY"))
    events = await _failed(conn)
    assert [e["errorCode"] for e in events] == ["DOCUMENT_PARSE_FAILED", "DOCUMENT_EMPTY"]
    assert len({e["eventId"] for e in events}) == 2


async def test_a_task_ended_by_its_documents_delete_is_not_announced(
    pool: asyncpg.Pool[Any], conn: asyncpg.Connection[Any]
) -> None:
    # DocumentDeleted answers for it: a requeued task refused by the tombstone adds nothing.
    await create_task(pool)
    queue = PgTaskQueue(pool)
    [lease] = await queue.claim("standard", "w1", lease_seconds=LEASE)
    assert (await queue.fail(lease, _dead("DOCUMENT_DELETED"))).status is TaskStatus.DEAD
    assert await _failed(conn) == []


async def test_a_worker_whose_document_cannot_be_indexed_answers_its_command(
    pool: asyncpg.Pool[Any], conn: asyncpg.Connection[Any]
) -> None:
    # End to end: the ingest path publishes, the worker's pipeline fails for good.
    tenant = (await add_tenant(conn, "acme")).tenant_id
    command_id = uuid.uuid4()
    answer = await _published_by_command(
        pool, publish_command(tenant, "blank", b" \n\t\n ", command_id=command_id)
    )
    async with running_pipeline(pool) as indexer:
        work = Worker(PgTaskQueue(pool), indexer, tier="standard", owner="w", policy=RetryPolicy())
        assert await work.run_once() is RunOnceResult.FAILED
    [event] = await _failed(conn)
    assert (event["taskId"], event["commandId"]) == (answer.task_id, command_id)
    assert event["errorCode"] == "DOCUMENT_EMPTY"
    assert await _events_of(conn, "DocumentSearchVersionSwitched") == 0


async def _events_of(conn: asyncpg.Connection[Any], event_type: str) -> int:
    count: int = await conn.fetchval(
        "SELECT count(*) FROM outbox WHERE event_type = $1", event_type
    )
    return count


async def test_a_burial_continues_the_trace_stored_with_its_task(
    pool: asyncpg.Pool[Any], conn: asyncpg.Connection[Any]
) -> None:
    # No attempt runs to bury an exhausted lease: the event continues the publish's trace.
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    clock = ManualClock(datetime.now(UTC))
    created = await create_task(pool, max_attempts=1, next_attempt_at=clock.now())
    await conn.execute(
        "UPDATE index_task SET traceparent = $2 WHERE task_id = $1", created.task_id, traceparent
    )
    queue = PgTaskQueue(pool, clock=clock)
    await queue.claim("standard", "w1", lease_seconds=LEASE)
    clock.advance(LEASE + 1)
    await queue.claim("standard", "w2", lease_seconds=LEASE)
    stored = await conn.fetchval("SELECT traceparent FROM outbox WHERE event_type = $1", FAILED)
    assert stored == traceparent
