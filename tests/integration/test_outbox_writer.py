"""The outbox writer: an event commits or rolls back with its producer's transaction, and
one document's events commit in the order of their positions."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import asyncpg
import pytest

from services.runtime.messaging.outbox import OutboxEvent, StoredEvent, add_event, aggregate_key
from services.runtime.settings import RuntimeSettings
from tests.support.kafka import TopicReader, relay_settings, relay_topics, running_relay

pytestmark = pytest.mark.integration


def _event_for(key: str) -> OutboxEvent:
    return OutboxEvent(
        event_type="Probe", tenant_id="acme", tier="standard", aggregate_key=key, payload=b"x"
    )


def _event() -> OutboxEvent:
    return OutboxEvent(
        event_type="Probe",
        tenant_id="acme",
        tier="standard",
        aggregate_key=aggregate_key("acme", uuid.uuid4()),
        payload=b"\xc3\x01body",
    )


async def test_event_commits_with_the_callers_transaction(conn: asyncpg.Connection[Any]) -> None:
    event = _event()
    async with conn.transaction():
        stored = await add_event(conn, event)
    row = await conn.fetchrow("SELECT * FROM outbox WHERE position = $1", stored.position)
    assert row is not None
    assert row["event_id"] == event.event_id
    assert row["payload"] == event.payload
    assert row["txid"] is not None


async def test_event_rolls_back_with_the_callers_transaction(
    conn: asyncpg.Connection[Any],
) -> None:
    class Boom(Exception):
        pass

    with pytest.raises(Boom):
        async with conn.transaction():
            await add_event(conn, _event())
            raise Boom
    assert await conn.fetchval("SELECT count(*) FROM outbox") == 0


async def test_outside_a_transaction_is_a_programming_error(
    conn: asyncpg.Connection[Any],
) -> None:
    with pytest.raises(RuntimeError, match="inside the producer's transaction"):
        await add_event(conn, _event())
    assert await conn.fetchval("SELECT count(*) FROM outbox") == 0


async def _blocked_or_done(
    observer: asyncpg.Connection[Any], pid: int, task: asyncio.Task[Any]
) -> None:
    """Until ``task`` has finished or its connection (``pid``) waits for a lock."""
    async with asyncio.timeout(30):
        while not task.done():
            waiting = await observer.fetchval(
                "SELECT (wait_event_type, wait_event) = ('Lock', 'advisory') FROM pg_stat_activity"
                " WHERE pid = $1",
                pid,
            )
            if waiting:
                return
            # Another backend's state: asking the server again is the only signal there is.
            await asyncio.sleep(0.01)


async def test_one_documents_events_commit_in_position_order_without_the_caller_locking(
    settings: RuntimeSettings, database_url: str, conn: asyncpg.Connection[Any]
) -> None:
    """Two writers of one document that take no lock of their own: B's add_event waits
    for A's transaction, so commit order = position order = the order the relay sends."""
    document = str(uuid.uuid4())
    key = aggregate_key("acme", document)
    first = await asyncpg.connect(database_url)
    second = await asyncpg.connect(database_url)
    try:
        tx_a = first.transaction()
        await tx_a.start()
        a = await add_event(first, _event_for(key))
        a_txid = await first.fetchval("SELECT pg_current_xact_id()")

        async def write_b() -> tuple[StoredEvent, str]:
            async with second.transaction():
                b = await add_event(second, _event_for(key))
                # The commit order as the server saw it, not the order the COMMIT replies
                # reach us: A's commit releases its locks before its reply is sent, so B
                # may take the lock, add its event, commit and be answered before A's
                # reply arrives. What must hold: A had committed before B's event existed.
                a_status = await second.fetchval("SELECT pg_xact_status($1)", a_txid)
            return b, a_status

        b_task = asyncio.create_task(write_b())
        await _blocked_or_done(conn, second.get_server_pid(), b_task)
        # A adds another event while B waits: had B taken its position before the lock,
        # it would lie between A's two and the relay would send B's event before A's second.
        a2 = await add_event(first, _event_for(key))
        await tx_a.commit()
        b, a_status_when_b_added = await b_task
        assert a_status_when_b_added == "committed", "B added its event while A was open"
        committed = [a.event_id, a2.event_id, b.event_id]
        positions = {
            r["event_id"]: r["position"]
            for r in await conn.fetch(
                "SELECT event_id, position FROM outbox WHERE aggregate_key = $1", key
            )
        }
        by_position = sorted(positions, key=positions.__getitem__)
        assert committed == by_position, "commit order differs from position order"

        s = relay_settings(settings)
        async with (
            TopicReader(s.kafka_bootstrap_servers, relay_topics(s)) as reader,
            running_relay(s),
        ):
            await reader.read_event_ids(committed)
        sent = [m.event_id for m in reader.messages if m.key == key]
        assert sent == committed
    finally:
        await first.close()
        await second.close()
