"""The relay against the real PostgreSQL and the shared Kafka: no row skipped, no stall
behind an open transaction, per-document order, several instances, replay, retention."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import uuid
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import asyncpg
import pytest

from services.relay.outbox_pg import PgLeaseStore, PgOutboxSource, create_relay_pool
from services.relay.ports import Lease, OutboxRecord, Progress, ReplayFilter
from services.relay.relay import Relay
from services.relay.replay import replay
from services.relay.settings import RelaySettings
from services.relay.sink_kafka import KafkaSink
from services.runtime.messaging.outbox import OutboxEvent, add_event, aggregate_key
from services.runtime.settings import RuntimeSettings
from tests.support.kafka import (
    TopicReader,
    publish,
    relay_settings,
    relay_topics,
    running_relay,
    wait_for_partitions,
)

pytestmark = pytest.mark.integration


def _event(
    document: str,
    event_type: str = "DocumentPublished",
    tier: str = "standard",
    payload: bytes = b"x",
) -> OutboxEvent:
    return OutboxEvent(
        event_type=event_type,
        tenant_id="acme",
        tier=tier,
        aggregate_key=aggregate_key("acme", document),
        payload=payload,
    )


async def test_out_of_order_commits_are_both_delivered(
    settings: RuntimeSettings, database_url: str
) -> None:
    s = relay_settings(settings)
    first = await asyncpg.connect(database_url)
    second = await asyncpg.connect(database_url)
    try:
        async with (
            TopicReader(s.kafka_bootstrap_servers, relay_topics(s)) as reader,
            running_relay(s),
        ):
            # A takes the lower position and stays open; B takes the next one and commits.
            tx_a = first.transaction()
            await tx_a.start()
            a = await add_event(first, _event("doc-a"))
            async with second.transaction():
                b = await add_event(second, _event("doc-b"))
            assert a.position < b.position
            # B is delivered while A is still open: the relay got past position a...
            await reader.read_event_ids([b.event_id])
            assert a.event_id not in {m.event_id for m in reader.messages}
            # ...and still delivers A once A commits, after B.
            await tx_a.commit()
            await reader.read_event_ids([a.event_id])
        order = [m.event_id for m in reader.messages]
        assert order.index(b.event_id) < order.index(a.event_id)
        assert {m.position for m in reader.messages} == {a.position, b.position}
    finally:
        await first.close()
        await second.close()


async def test_a_long_open_transaction_does_not_hold_back_later_commits(
    settings: RuntimeSettings, database_url: str, conn: asyncpg.Connection[Any]
) -> None:
    s = relay_settings(settings, relay_batch_size=7)
    long_open = await asyncpg.connect(database_url)
    try:
        async with TopicReader(s.kafka_bootstrap_servers, relay_topics(s)) as reader:
            tx = long_open.transaction()
            await tx.start()
            held = await add_event(long_open, _event("doc-held"))
            async with running_relay(s):
                later = [(await publish(conn)).event_id for _ in range(25)]
                # Several windows and batches (batch size 7) go by while it stays open.
                await reader.read_event_ids(later)
                later_more = [(await publish(conn)).event_id for _ in range(5)]
                await reader.read_event_ids(later_more)
                assert held.event_id not in {m.event_id for m in reader.messages}
                await tx.commit()
                await reader.read_event_ids([held.event_id])
        delivered = [m.event_id for m in reader.messages]
        assert sorted(map(str, delivered)) == sorted(map(str, {*later, *later_more, held.event_id}))
    finally:
        await long_open.close()


async def test_versions_of_one_document_arrive_in_order(
    settings: RuntimeSettings, pool: asyncpg.Pool[Any]
) -> None:
    s = relay_settings(settings, relay_batch_size=16)
    documents = [str(uuid.uuid4()) for _ in range(6)]
    versions = 15

    next_version = dict.fromkeys(documents, 1)

    async def publish_versions(document: str) -> None:
        # Three writers per document race to publish its next version; like the publisher,
        # each serialises on the document (here a transaction-scoped advisory lock) before
        # it picks the version number and writes the outbox row, so versions commit in order.
        async with pool.acquire() as pooled:
            conn: asyncpg.Connection[Any] = pooled  # type: ignore[assignment]
            while True:
                async with conn.transaction():
                    await conn.execute("SELECT pg_advisory_xact_lock(hashtext($1))", document)
                    version = next_version[document]
                    if version > versions:
                        return
                    next_version[document] = version + 1
                    await add_event(conn, _event(document, payload=str(version).encode()))

    async with (
        TopicReader(s.kafka_bootstrap_servers, relay_topics(s)) as reader,
        running_relay(s),
    ):
        await asyncio.gather(*(publish_versions(d) for d in documents for _ in range(3)))
        await reader.read_until(lambda seen: len(seen) >= len(documents) * versions)
    by_key: dict[str, list[int]] = collections.defaultdict(list)
    for message in reader.messages:
        by_key[message.key].append(int(message.value))
    assert by_key == {aggregate_key("acme", d): list(range(1, versions + 1)) for d in documents}


async def test_routing_key_and_headers(
    settings: RuntimeSettings, conn: asyncpg.Connection[Any]
) -> None:
    s = relay_settings(settings)
    topics = relay_topics(s, tiers=("standard", "premium"))
    async with TopicReader(s.kafka_bootstrap_servers, topics) as reader, running_relay(s):
        hint = await publish(conn, document="d1", event_type="IndexTaskCreated", tier="premium")
        lifecycle = await publish(conn, document="d1", event_type="DocumentPublished")
        await reader.read_event_ids([hint.event_id, lifecycle.event_id])
    by_id = {m.event_id: m for m in reader.messages}
    assert by_id[hint.event_id].topic == s.topic("kb.index-hints.premium")
    assert by_id[lifecycle.event_id].topic == s.topic("kb.document-events")
    assert by_id[hint.event_id].key == "acme/d1"
    assert by_id[hint.event_id].headers == {
        "event_type": "IndexTaskCreated",
        "event_id": str(hint.event_id),
        "tenant_id": "acme",
        "outbox_position": str(hint.position),
        "replay": "false",
    }


async def test_a_switch_event_carries_a_search_token_past_its_commit(
    settings: RuntimeSettings, conn: asyncpg.Connection[Any]
) -> None:
    """docs/scaling.md#read-your-switch: the token is read after the switch committed."""
    s = relay_settings(settings)
    async with TopicReader(s.kafka_bootstrap_servers, relay_topics(s)) as reader:
        async with conn.transaction():
            switched = _event("d1", event_type="DocumentSearchVersionSwitched")
            await add_event(conn, switched)
            before_commit = await conn.fetchval("SELECT pg_current_wal_insert_lsn()")
        other = await publish(conn, document="d2", event_type="DocumentPublished")
        async with running_relay(s):
            await reader.read_event_ids([switched.event_id, other.event_id])
    by_id = {m.event_id: m for m in reader.messages}
    token = by_id[switched.event_id].headers["search_token"]
    high, _, low = token.partition("/")
    assert (int(high, 16) << 32 | int(low, 16)) > before_commit
    assert "search_token" not in by_id[other.event_id].headers


async def test_two_relays_split_the_partitions_and_hand_over(
    settings: RuntimeSettings, conn: asyncpg.Connection[Any]
) -> None:
    first_settings = relay_settings(settings, relay_max_partitions_per_instance=2)
    second_settings = relay_settings(settings)  # takes whatever is free
    # (partition, epoch, owner) of every batch acknowledged, in the order it happened.
    driven: list[tuple[int, int, str]] = []

    async def record(lease: Lease, records: Sequence[OutboxRecord]) -> None:
        driven.append((lease.partition, lease.epoch, lease.owner))

    def relay(s: RelaySettings, owner: str) -> contextlib.AbstractAsyncContextManager[Relay]:
        return running_relay(s, owner=owner, after_ack=record)

    async with TopicReader(
        settings.kafka_bootstrap_servers, relay_topics(first_settings)
    ) as reader:
        async with relay(second_settings, "relay-b") as second:
            await wait_for_partitions(second, 4)
            async with relay(first_settings, "relay-a") as first:
                # b took all four; a gets none while b holds them (a few rounds of asking).
                async with asyncio.timeout(30):
                    await first.wait_for_rounds(3)
                assert first.partitions == set()
        async with relay(first_settings, "relay-a") as first:
            await wait_for_partitions(first, 2)
            async with relay(second_settings, "relay-b") as second:
                await wait_for_partitions(second, 2)
                assert first.partitions.isdisjoint(second.partitions)
                wave_one = [(await publish(conn)).event_id for _ in range(60)]
                await reader.read_event_ids(wave_one)
                leases = await conn.fetch("SELECT owner FROM relay_partition")
                assert {r["owner"] for r in leases} == {"relay-a", "relay-b"}
            # b stopped cleanly and released its leases; a stays at its cap of two, and a
            # newcomer takes the released ones over at once.
            assert len(first.partitions) == 2
            wave_two = [(await publish(conn, document=f"d{i}")).event_id for i in range(12)]
            async with relay(second_settings, "relay-c") as third:
                await wait_for_partitions(third, 2)
                await reader.read_event_ids(wave_two)
    counts = collections.Counter(m.event_id for m in reader.messages)
    assert set(counts) == {*wave_one, *wave_two}
    # Hand-overs were clean (progress recorded, lease released): no event went twice.
    assert max(counts.values()) == 1
    # One driver per partition at a time: each epoch has one owner, and once a partition
    # moved to a newer epoch no batch of an older one was acknowledged any more.
    owners_by_epoch = {(p, e): o for p, e, o in driven}
    assert len(owners_by_epoch) == len(set(driven))
    for partition in {p for p, _, _ in driven}:
        epochs = [e for p, e, _ in driven if p == partition]
        assert epochs == sorted(epochs)
    assert {o for _, _, o in driven} == {"relay-a", "relay-b", "relay-c"}


async def test_a_relay_that_lost_its_lease_cannot_move_progress(
    settings: RuntimeSettings, conn: asyncpg.Connection[Any]
) -> None:
    pool = await create_relay_pool(settings)
    try:
        leases = PgLeaseStore(pool)
        await leases.ensure_partitions(2)
        now = await conn.fetchval("SELECT now()")
        [old] = await leases.acquire("relay-a", 1, lease_s=5, now=now)
        assert (old.partition, old.epoch) == (0, 1)
        # Within the lease nobody else gets partition 0.
        [other] = await leases.acquire("relay-b", 5, lease_s=5, now=now)
        assert other.partition == 1
        later = now + timedelta(seconds=6)
        [taken] = await leases.acquire("relay-b", 1, lease_s=5, now=later)
        assert (taken.partition, taken.epoch) == (0, 2)
        moved = Progress(delivered=await conn.fetchval("SELECT pg_current_snapshot()::text"))
        assert not await leases.commit_progress(old, moved, 5, now=later)
        assert not await leases.renew(old, 5, now=later)
        assert await leases.commit_progress(taken, moved, 5, now=later)
        row = await conn.fetchrow("SELECT owner, epoch FROM relay_partition WHERE partition = 0")
        assert row is not None
        assert dict(row) == {"owner": "relay-b", "epoch": 2}
    finally:
        await pool.close()


async def test_partition_count_cannot_change(settings: RuntimeSettings) -> None:
    from services.runtime.errors import ConfigError

    pool = await create_relay_pool(settings)
    try:
        await PgLeaseStore(pool).ensure_partitions(4)
        with pytest.raises(ConfigError):
            await PgLeaseStore(pool).ensure_partitions(8)
    finally:
        await pool.close()


async def test_replay_resends_exactly_the_range_with_the_flag(
    settings: RuntimeSettings, conn: asyncpg.Connection[Any]
) -> None:
    s = relay_settings(settings)
    async with TopicReader(s.kafka_bootstrap_servers, relay_topics(s)) as reader:
        async with running_relay(s):
            stored = [
                await publish(conn, event_type="IndexTaskCreated" if i % 3 == 0 else "Other")
                for i in range(30)
            ]
            await reader.read_event_ids([e.event_id for e in stored])
        await reader.read_to_end()  # the live relay has stopped: all it sent, duplicates too
        live = len(reader.messages)
        positions = [e.position for e in stored]
        low, high = positions[10], positions[20]
        pool = await create_relay_pool(s)
        sink = KafkaSink(s, client_id="replay-test")
        try:
            await sink.start()
            result = await replay(
                PgOutboxSource(pool),
                sink,
                ReplayFilter(after_position=low - 1, up_to_position=high),
                rate=500,
                batch_size=4,
            )
            typed = await replay(
                PgOutboxSource(pool),
                sink,
                ReplayFilter(
                    after_position=low - 1,
                    up_to_position=high,
                    event_type="IndexTaskCreated",
                    tier="standard",
                    tenant_id="acme",
                ),
            )
        finally:
            await sink.stop()
            await pool.close()
        assert result.sent == 11
        wanted_typed = [p for i, p in enumerate(positions) if i % 3 == 0 and low <= p <= high]
        assert typed.sent == len(wanted_typed)
        # Both replays are over (their producer stopped): everything they sent lies before
        # the log's end, so reading to it sees any message too many.
        await reader.read_to_end()
    replayed = [m for m in reader.messages if m.replay]
    assert len(reader.messages) == live + len(replayed)
    assert sorted(m.position for m in replayed) == sorted(list(range(low, high + 1)) + wanted_typed)


async def test_retention_deletes_only_delivered_rows_in_batches(
    settings: RuntimeSettings, conn: asyncpg.Connection[Any]
) -> None:
    s = relay_settings(settings, relay_partitions=2)
    async with (
        TopicReader(s.kafka_bootstrap_servers, relay_topics(s)) as reader,
        running_relay(s),
    ):
        delivered = [await publish(conn) for _ in range(10)]
        await reader.read_event_ids([e.event_id for e in delivered])
    # Written while no relay runs: old enough, but not delivered.
    pending = [await publish(conn) for _ in range(5)]
    pool = await create_relay_pool(s)
    try:
        source = PgOutboxSource(pool)
        backlog = await source.backlog()
        assert backlog.rows == 5
        future = await conn.fetchval("SELECT now() + interval '8 days'")
        deleted = await source.delete_delivered(7 * 86400, batch=3, now=future)
        assert deleted == 10
        left = await conn.fetch("SELECT event_id FROM outbox ORDER BY position")
        assert [r["event_id"] for r in left] == [e.event_id for e in pending]
        # Not old enough yet: nothing goes.
        assert await source.delete_delivered(7 * 86400, batch=3) == 0
    finally:
        await pool.close()


async def test_a_window_left_half_drained_is_resumed_by_the_next_owner(
    settings: RuntimeSettings, conn: asyncpg.Connection[Any]
) -> None:
    s = relay_settings(settings, relay_partitions=1, relay_batch_size=4)
    stored = [await publish(conn) for _ in range(30)]  # one window, eight batches
    batches: asyncio.Queue[int] = asyncio.Queue()
    carry_on = asyncio.Event()

    async def hold_after_second(lease: Lease, records: Sequence[OutboxRecord]) -> None:
        await batches.put(len(records))
        if batches.qsize() >= 2:
            await carry_on.wait()

    async with TopicReader(s.kafka_bootstrap_servers, relay_topics(s)) as reader:
        first = running_relay(s, owner="relay-a", after_ack=hold_after_second)
        relay_a = await first.__aenter__()
        try:
            await batches.get()
            await batches.get()
            stopping = asyncio.create_task(relay_a.stop())
            await asyncio.sleep(0)
            carry_on.set()
            await stopping
        finally:
            await first.__aexit__(None, None, None)
        row = await conn.fetchrow(
            "SELECT owner, window_snapshot IS NOT NULL AS open, window_position, window_end"
            " FROM relay_partition"
        )
        assert row is not None
        assert row["owner"] is None
        assert row["open"], "the relay was meant to stop in the middle of a window"
        assert stored[7].position <= row["window_position"] < row["window_end"]
        async with running_relay(s, owner="relay-b"):
            await reader.read_event_ids([e.event_id for e in stored])
    counts = collections.Counter(m.event_id for m in reader.messages)
    assert set(counts) == {e.event_id for e in stored}
    assert max(counts.values()) == 1  # b went on exactly where a had stopped
    for kafka_partition in {m.partition for m in reader.messages}:
        positions = [m.position for m in reader.messages if m.partition == kafka_partition]
        assert positions == sorted(positions)


async def _drain(
    source: PgOutboxSource, lease: Lease, progress: Progress, limit: int
) -> tuple[Progress, list[OutboxRecord], int]:
    """Read the partition until nothing new is left: where it stands, what it read, and
    how many reads that took."""
    records: list[OutboxRecord] = []
    reads = 0
    while True:
        batch = await source.read_window_batch(lease, progress, limit)
        reads += 1
        records.extend(batch.records)
        progress = batch.following
        if progress.window is None and not batch.records:
            return progress, records, reads


async def test_a_late_commit_is_drained_without_reading_the_rows_delivered_meanwhile(
    settings: RuntimeSettings, database_url: str, conn: asyncpg.Connection[Any]
) -> None:
    s = relay_settings(settings, relay_partitions=1)
    pool = await create_relay_pool(s)
    long_open = await asyncpg.connect(database_url)
    try:
        leases = PgLeaseStore(pool)
        await leases.ensure_partitions(1)
        [lease] = await leases.acquire("relay-a", 1, lease_s=60)
        source = PgOutboxSource(pool)
        tx = long_open.transaction()
        await tx.start()
        held = await add_event(long_open, _event("doc-held"))
        meanwhile = [await publish(conn) for _ in range(60)]
        progress, records, _ = await _drain(source, lease, lease.progress, limit=4)
        assert [r.event_id for r in records] == [e.event_id for e in meanwhile]
        await tx.commit()
        after = [await publish(conn) for _ in range(3)]
        _, records, reads = await _drain(source, lease, progress, limit=4)
        assert [r.event_id for r in records] == [held.event_id, *(e.event_id for e in after)]
        # One read for the window (4 rows: the late one and the three after it), one that
        # finds nothing new. Reading by position range from the late row instead would walk
        # the 60 delivered rows in between, 4 positions a read.
        assert reads == 2
    finally:
        await long_open.close()
        await pool.close()


async def test_writers_notify_only_while_the_doorbell_is_armed(
    database_url: str, conn: asyncpg.Connection[Any]
) -> None:
    listener = await asyncpg.connect(database_url)
    heard: asyncio.Queue[str] = asyncio.Queue()
    try:
        await listener.add_listener("kb_outbox", lambda *args: heard.put_nowait(args[-1]))
        # Disarmed (a relay was woken and is busy): the insert sends nothing. Notifications
        # arrive in commit order, so the sentinel sent after it is the first thing heard.
        await conn.execute("UPDATE relay_doorbell SET armed = false")
        await publish(conn)
        await conn.execute("SELECT pg_notify('kb_outbox', 'sentinel')")
        async with asyncio.timeout(10):
            assert await heard.get() == "sentinel"
        # Armed (a relay waits): the insert rings.
        await conn.execute("UPDATE relay_doorbell SET armed = true")
        await publish(conn)
        await conn.execute("SELECT pg_notify('kb_outbox', 'sentinel')")
        async with asyncio.timeout(10):
            assert await heard.get() == ""
            assert await heard.get() == "sentinel"
    finally:
        await listener.close()


async def test_one_instance_deletes_at_a_time(
    settings: RuntimeSettings, conn: asyncpg.Connection[Any]
) -> None:
    s = relay_settings(settings, relay_partitions=1)
    pool = await create_relay_pool(s)
    try:
        leases = PgLeaseStore(pool)
        await leases.ensure_partitions(1)
        [lease] = await leases.acquire("relay-a", 1, lease_s=60)
        for _ in range(3):
            await publish(conn)
        delivered = await conn.fetchval("SELECT pg_current_snapshot()::text")
        assert await leases.commit_progress(lease, Progress(delivered=delivered), 60)
        # Delivered: committed as the snapshot was taken, whatever else the cluster had open
        # (a test database being cloned beside this one, say).
        deletable = await conn.fetchval(
            "SELECT count(*) FROM outbox WHERE pg_visible_in_snapshot(txid, $1::text::pg_snapshot)",
            delivered,
        )
        assert deletable == 3
        future = await conn.fetchval("SELECT now() + interval '8 days'")
        source = PgOutboxSource(pool)
        lock = "hashtextextended('kb.relay.retention', 0)"
        await conn.execute(f"SELECT pg_advisory_lock({lock})")  # another instance deletes
        assert await source.delete_delivered(7 * 86400, batch=10, now=future) == 0
        assert await conn.fetchval("SELECT count(*) FROM outbox") == 3
        await conn.execute(f"SELECT pg_advisory_unlock({lock})")
        assert await source.delete_delivered(7 * 86400, batch=10, now=future) == deletable
    finally:
        await pool.close()


async def test_retention_is_not_held_back_by_an_unrelated_open_transaction(
    settings: RuntimeSettings, database_url: str, conn: asyncpg.Connection[Any]
) -> None:
    s = relay_settings(settings, relay_partitions=2)
    unrelated = await asyncpg.connect(database_url)
    try:
        tx = unrelated.transaction()
        await tx.start()
        await unrelated.fetchval("SELECT pg_current_xact_id()")  # open, with a txid
        async with (
            TopicReader(s.kafka_bootstrap_servers, relay_topics(s)) as reader,
            running_relay(s),
        ):
            delivered = [await publish(conn) for _ in range(5)]
            await reader.read_event_ids([e.event_id for e in delivered])
        pool = await create_relay_pool(s)
        try:
            future = await conn.fetchval("SELECT now() + interval '8 days'")
            deleted = await PgOutboxSource(pool).delete_delivered(7 * 86400, 10, now=future)
        finally:
            await pool.close()
        assert deleted == 5
        await tx.rollback()
    finally:
        await unrelated.close()
