"""Retention of superseded versions' content (services/indexer/gc/retention.py, migration
0032) on real PostgreSQL: exactly the content superseded for longer than the period, by the
database's clock, goes (bytes and chunks of every generation); the served, the latest
published and the in-flight versions stay, and so does every version's metadata; a deleted
document's superseded versions are covered, its last version is not; a pass is idempotent;
a publish during a pass is neither blocked nor harmed; a collector killed mid-pass loses
nothing and a rerun finishes; a requeued task of an emptied version ends with
VERSION_CONTENT_REMOVED; the counters count what was removed."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import sys
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg
import pytest
from prometheus_client import REGISTRY

from services.embedding.hashing import HashingEmbedder
from services.index.generation import IndexGeneration
from services.indexer.gc.retention import RetentionCollector, RetentionPass
from services.indexer.gc.settings import RetentionSettings
from services.indexer.queue.store_pg import PgTaskQueue
from services.indexer.queue.worker import RunOnceResult, Worker
from services.indexer.retry import RetryPolicy
from services.indexer.sink.pgvector import PgVectorSink
from services.indexer.task import ErrorCode, Lease
from services.runtime.indexing.tasks import TaskStatus
from services.runtime.settings import RuntimeSettings
from tests.support.api import add_tenant, publish, publisher_harness, upload
from tests.support.cli import kb
from tests.support.locks import wait_until_blocked_on_a_lock
from tests.support.pipeline import running_pipeline
from tests.support.stack import REPO_ROOT
from tests.support.tasks import CreatedTask, create_task, supersede_40_days_ago
from tests.support.versions import make_chunks, publish_version

pytestmark = pytest.mark.integration

EMBEDDER = HashingEmbedder(dimension=64)
GENERATION = IndexGeneration(EMBEDDER.model, EMBEDDER.dimension, "heading-semchunk-v1:max=64")
OTHER_MODEL = IndexGeneration("other-model-64", EMBEDDER.dimension, GENERATION.chunking_strategy)
DAYS = 30


def retention(pool: asyncpg.Pool[Any], **options: int) -> RetentionCollector:
    settings = {"superseded_days": DAYS, "batch_versions": 100, "batch_rows": 1000, **options}
    return RetentionCollector(pool, RetentionSettings.model_validate(settings))


async def db_time(pool: asyncpg.Pool[Any], days: int) -> datetime:
    """The database's clock ``days`` from now: the injected now of a pass."""
    at: datetime = await pool.fetchval("SELECT now() + make_interval(days => $1)", days)
    return at


async def claim(queue: PgTaskQueue, task_id: uuid.UUID) -> Lease:
    [lease] = await queue.claim("standard", "w", lease_seconds=60)
    assert lease.task_id == task_id
    return lease


async def index(pool: asyncpg.Pool[Any], sink: PgVectorSink, task_id: uuid.UUID, n: int) -> None:
    """Claims the task and completes it with ``n`` chunks of the serving generation, plus
    one chunk of another model's generation written beside them (as a build writes it)."""
    queue = PgTaskQueue(pool)
    lease = await claim(queue, task_id)
    texts = [f"clause {i} of v{lease.version_number}" for i in range(n)]
    strategy = GENERATION.chunking_strategy
    chunks = make_chunks(lease.document_id, lease.version_number, texts, strategy)
    await queue.complete(
        lease, in_transaction=sink.writer(lease, GENERATION, chunks, EMBEDDER.embed_sync(texts))
    )
    beside = make_chunks(lease.document_id, lease.version_number, ["beside"], strategy)
    async with pool.acquire() as conn, conn.transaction():
        await sink.writer(lease, OTHER_MODEL, beside, EMBEDDER.embed_sync(["beside"]))(conn)


@dataclass(frozen=True)
class Version:
    content: bytes
    sha256: bytes
    size_bytes: int
    content_removed: bool
    chunks: int


async def versions(pool: asyncpg.Pool[Any], document_id: uuid.UUID) -> dict[int, Version]:
    rows = await pool.fetch(
        """SELECT v.version_number, v.content, v.sha256, v.size_bytes,
                  v.content_removed_at IS NOT NULL AS removed,
                  (SELECT count(*) FROM knowledge_chunk c
                    WHERE c.document_id = v.document_id
                      AND c.version_number = v.version_number) AS chunks
             FROM document_version v WHERE v.document_id = $1 ORDER BY 1""",
        document_id,
    )
    return {
        r["version_number"]: Version(
            bytes(r["content"]), bytes(r["sha256"]), r["size_bytes"], r["removed"], r["chunks"]
        )
        for r in rows
    }


def intact(v: Version) -> bool:
    return (
        not v.content_removed
        and len(v.content) == v.size_bytes
        and hashlib.sha256(v.content).digest() == v.sha256
    )


def emptied(v: Version) -> bool:
    return v.content_removed and v.content == b"" and v.chunks == 0 and v.size_bytes > 0


@dataclass(frozen=True)
class Corpus:
    served: CreatedTask  # v1 superseded (indexed), v2 served and superseded, v3 in flight
    racing: CreatedTask  # v1 running while v2 was published and served
    deleted: CreatedTask  # v1 superseded, v2 served, then deleted


async def corpus(pool: asyncpg.Pool[Any]) -> Corpus:
    sink = PgVectorSink(pool)
    for generation in (GENERATION, OTHER_MODEL):
        await sink.ensure_generation(generation)

    served = await create_task(pool)
    await index(pool, sink, served.task_id, 4)
    await index(pool, sink, await publish_version(pool, served, 2), 3)

    racing = await create_task(pool)
    await claim(PgTaskQueue(pool), racing.task_id)  # v1 stays RUNNING
    await index(pool, sink, await publish_version(pool, racing, 2), 2)

    deleted = await create_task(pool)
    await index(pool, sink, deleted.task_id, 2)
    await index(pool, sink, await publish_version(pool, deleted, 2), 2)
    # The delete's tombstone (services/publisher/queries.sql: tombstone_search_pointer).
    await pool.execute(
        """WITH d AS (UPDATE document SET deleted_at = now() WHERE document_id = $1)
           UPDATE document_search_version
              SET deleted_at = now(), chunking_strategy = NULL, chunk_count = 0
            WHERE document_id = $1""",
        deleted.document_id,
    )

    await publish_version(pool, served, 3)  # its task stays PENDING: in flight, latest
    return Corpus(served, racing, deleted)


async def test_a_publish_through_the_api_supersedes_the_versions_below_it(
    settings: RuntimeSettings, conn: asyncpg.Connection[Any]
) -> None:
    """The trigger runs in the publish's transaction, as the API's tenant role (behind the
    tenant wall): the versions below the new one get its published_at, the new one and a
    draft above it get nothing; an ACL-only re-publish changes nothing."""
    tenant = await add_tenant(conn, "acme")
    async with publisher_harness(settings) as harness:
        client = harness.client
        first = (await upload(client, tenant, b"v1")).json()
        document_id = first["documentId"]
        first_publish = (await publish(client, tenant, document_id, 1, first["revision"])).json()
        for content in (b"v2", b"v3", b"v4"):
            added = await upload(client, tenant, content, document_id=document_id)
            assert added.status_code == 201, added.text
        published = await publish(client, tenant, document_id, 3, added.json()["revision"])
        assert published.status_code == 202, published.text
        again = await publish(
            client, tenant, document_id, 3, published.json()["revision"], read=["group:x"]
        )
        assert again.status_code == 202, again.text
    assert first_publish["versionNumber"] == 1
    rows = await conn.fetch(
        "SELECT version_number, superseded_at, published_at FROM document_version"
        " WHERE document_id = $1 ORDER BY 1",
        uuid.UUID(document_id),
    )
    v3_published = rows[2]["published_at"]
    assert [row["superseded_at"] for row in rows] == [v3_published, v3_published, None, None]


async def test_retention_removes_exactly_the_superseded_content_past_the_period(
    pool: asyncpg.Pool[Any],
) -> None:
    docs = await corpus(pool)
    before = {d.document_id: await versions(pool, d.document_id) for d in docs.__dict__.values()}
    # The newer versions' publish stamped the older ones superseded, on the database's clock.
    assert (
        await pool.fetchval("SELECT count(*) FROM document_version WHERE superseded_at IS NOT NULL")
        == 4
    )
    counted = {
        name: REGISTRY.get_sample_value(f"kb_retention_{name}_removed_total") or 0.0
        for name in ("versions", "bytes", "chunks")
    }

    # Now and 29 days on: nothing is due yet.
    assert await retention(pool).collect() == RetentionPass(0, 0, 0)
    assert await retention(pool).collect(now=await db_time(pool, DAYS - 1)) == RetentionPass(
        0, 0, 0
    )
    late = await db_time(pool, DAYS + 1)
    # Zero days keeps everything forever.
    assert await retention(pool, superseded_days=0).collect(now=late) == RetentionPass(0, 0, 0)
    # 31 days on: the superseded versions no pointer names and no task is about to read.
    done = await retention(pool).collect(now=late)
    served_v1 = before[docs.served.document_id][1]
    deleted_v1 = before[docs.deleted.document_id][1]
    assert done == RetentionPass(
        versions=2,
        bytes=served_v1.size_bytes + deleted_v1.size_bytes,
        chunks=served_v1.chunks + deleted_v1.chunks,
    )
    assert served_v1.chunks == 5  # four of the generation, one beside it

    after = {d.document_id: await versions(pool, d.document_id) for d in docs.__dict__.values()}
    served, racing, deleted = (after[d.document_id] for d in docs.__dict__.values())
    assert emptied(served[1])
    assert intact(served[2])  # served (the pointer) while v3 indexes
    assert served[2].chunks == 4
    assert intact(served[3])  # the latest published, its task in flight
    assert intact(racing[1])  # its task still running
    assert intact(racing[2])
    assert emptied(deleted[1])
    assert intact(deleted[2])  # the deleted document's last version: the erase's to remove
    # The metadata stays: every row, its hash and size.
    for document_id, old in before.items():
        assert {n: (v.sha256, v.size_bytes) for n, v in after[document_id].items()} == {
            n: (v.sha256, v.size_bytes) for n, v in old.items()
        }
    assert (
        await pool.fetchval(
            "SELECT count(*) FROM document_search_version WHERE deleted_at IS NOT NULL"
        )
        == 1
    )

    # Idempotent: a second pass finds nothing and changes nothing.
    assert await retention(pool).collect(now=late) == RetentionPass(0, 0, 0)
    assert {d: await versions(pool, d) for d in after} == after
    # Counted once, by what was removed.
    assert {
        name: (REGISTRY.get_sample_value(f"kb_retention_{name}_removed_total") or 0.0)
        - counted[name]
        for name in counted
    } == {"versions": 2.0, "bytes": float(done.bytes), "chunks": float(done.chunks)}
    totals = await retention(pool).sample_totals()
    assert (totals["removed_versions"], totals["removed_bytes"]) == (2.0, float(done.bytes))
    assert totals["deleted_documents"] == 1.0
    assert REGISTRY.get_sample_value("kb_retention_removed_versions") == 2.0


async def test_the_pass_reads_the_database_clock_not_the_hosts(
    pool: asyncpg.Pool[Any], database_url: str
) -> None:
    """now() resolved through the session's search_path: a schema ahead of pg_catalog moves
    the database's clock 31 days on for one pool only. The host's clock does not move: a
    pass on that pool removes what is due by the database's clock alone."""
    docs = await corpus(pool)
    await pool.execute(
        """CREATE SCHEMA later;
           CREATE FUNCTION later.now() RETURNS timestamptz LANGUAGE sql STABLE
               AS $$ SELECT pg_catalog.now() + interval '31 days' $$"""
    )
    assert await retention(pool).collect() == RetentionPass(0, 0, 0)
    moved = await asyncpg.create_pool(
        database_url,
        min_size=1,
        max_size=2,
        server_settings={"search_path": "later, pg_catalog, public"},
    )
    try:
        done = await retention(moved).collect()
    finally:
        await moved.close()
    assert done.versions == 2
    assert emptied((await versions(pool, docs.served.document_id))[1])
    # content_removed_at is the moved clock's: 31 days after the supersede.
    gap = await pool.fetchval(
        """SELECT extract(day FROM content_removed_at - superseded_at)::int
             FROM document_version WHERE document_id = $1 AND version_number = 1""",
        docs.served.document_id,
    )
    assert gap == 31


async def test_a_requeued_task_of_an_emptied_version_ends_with_a_stable_code(
    pool: asyncpg.Pool[Any],
) -> None:
    docs = await corpus(pool)
    await retention(pool).collect(now=await db_time(pool, DAYS + 1))
    queue = PgTaskQueue(pool)
    # The served document's v3 is in flight: finish it first, as a repair would find it.
    await pool.execute(
        "UPDATE index_task SET status = 'DEAD', error_code = 'DOCUMENT_PARSE_FAILED',"
        " finished_at = now() WHERE document_id = $1 AND version_number = 3",
        docs.served.document_id,
    )
    # A repair's re-run of v1's finished task.
    record = await queue.requeue_from(
        TaskStatus.SUCCEEDED, docs.served.task_id, by="repair", reset_attempts=True, budget=8
    )
    assert record is not None
    async with running_pipeline(pool) as indexer:
        worker = Worker(queue, indexer, tier="standard", owner="it", policy=RetryPolicy(jitter=0))
        assert await worker.run_once() is RunOnceResult.FAILED
    row = await pool.fetchrow(
        "SELECT status, error_code FROM index_task WHERE task_id = $1", docs.served.task_id
    )
    assert row is not None
    assert (row["status"], row["error_code"]) == ("DEAD", ErrorCode.VERSION_CONTENT_REMOVED)
    assert emptied((await versions(pool, docs.served.document_id))[1])


async def test_a_publish_during_a_pass_is_not_blocked_and_stays_whole(
    pool: asyncpg.Pool[Any],
) -> None:
    docs = await corpus(pool)
    late = await db_time(pool, DAYS + 1)
    async with pool.acquire() as holder, holder.transaction():
        # Holds the served document's v1 task: the pass waits inside its first batch,
        # holding the versions it took.
        await holder.execute(
            "SELECT 1 FROM index_task WHERE task_id = $1 FOR UPDATE", docs.served.task_id
        )
        passing = asyncio.create_task(retention(pool, batch_versions=1).collect(now=late))
        await wait_until_blocked_on_a_lock(pool)
        # A publish of the same document meanwhile: v4 supersedes v3 (the trigger) and
        # commits while the pass holds v1.
        await publish_version(pool, docs.served, 4)
        assert not passing.done()
    done = await passing
    assert done.versions == 2
    after = await versions(pool, docs.served.document_id)
    assert emptied(after[1])
    # v2 (superseded long ago by the injected clock) is still what search serves; v3,
    # superseded by the publish during the pass, has its task in flight.
    assert [intact(after[n]) for n in (2, 3, 4)] == [True, True, True]
    assert (
        await pool.fetchval(
            "SELECT published_version FROM document WHERE document_id = $1", docs.served.document_id
        )
        == 4
    )
    superseded = await pool.fetchval(
        "SELECT superseded_at IS NOT NULL FROM document_version"
        " WHERE document_id = $1 AND version_number = 3",
        docs.served.document_id,
    )
    assert superseded


async def test_chunks_another_deleter_holds_are_skipped_and_the_content_waits_for_them(
    pool: asyncpg.Pool[Any],
) -> None:
    """A chunk row locked by someone else (the collector of superseded chunks deleting the
    same version) is not waited for: the pass goes on, and the version keeps its bytes until
    a later pass finds none of its chunks left. (Were it waited for, the pass would hang.)"""
    docs = await corpus(pool)
    late = await db_time(pool, DAYS + 1)
    async with pool.acquire() as holder, holder.transaction():
        await holder.execute(
            "SELECT 1 FROM knowledge_chunk WHERE document_id = $1 AND version_number = 1"
            " LIMIT 1 FOR UPDATE",
            docs.served.document_id,
        )
        first = await retention(pool).collect(now=late)
    assert first.versions == 1  # the deleted document's v1
    waiting = (await versions(pool, docs.served.document_id))[1]
    assert (waiting.content_removed, waiting.chunks) == (False, 1)
    assert intact(waiting)

    assert await retention(pool).collect(now=late) == RetentionPass(1, waiting.size_bytes, 1)
    assert emptied((await versions(pool, docs.served.document_id))[1])


async def test_an_erase_and_a_delete_during_a_pass_finish_and_leave_no_content(
    pool: asyncpg.Pool[Any], settings: RuntimeSettings, conn: asyncpg.Connection[Any]
) -> None:
    """A pass holds the deleted document's v1 (its task is held here, so the pass waits
    inside that batch); an erase of that document runs meanwhile and waits for the version
    row, and a delete of the racing document commits without waiting. Once the pass goes on,
    both finish: the erased document holds no content and no chunk, whichever emptied v1."""
    tenant = await add_tenant(conn, "acme")
    docs = await corpus(pool)
    late = await db_time(pool, DAYS + 1)
    async with publisher_harness(settings) as harness:
        client = harness.client
        async with pool.acquire() as holder, holder.transaction():
            await holder.execute(
                "SELECT 1 FROM index_task WHERE task_id = $1 FOR UPDATE", docs.deleted.task_id
            )
            passing = asyncio.create_task(retention(pool, batch_versions=1).collect(now=late))
            await wait_until_blocked_on_a_lock(pool)
            erasing = asyncio.create_task(
                client.post(
                    tenant.path(f"/documents/{docs.deleted.document_id}/erase"),
                    headers=tenant.headers,
                )
            )
            await wait_until_blocked_on_a_lock(pool, backends=2)
            status = await client.get(
                tenant.path(f"/documents/{docs.racing.document_id}"), headers=tenant.headers
            )
            gone = await client.delete(
                tenant.path(f"/documents/{docs.racing.document_id}"),
                params={"revision": status.json()["revision"]},
                headers=tenant.headers,
            )
            assert gone.status_code == 200, gone.text
        erased = await erasing
        done = await passing
    assert erased.status_code == 200, erased.text
    assert erased.json()["erasedAt"] is not None
    assert done.versions in (2, 3)  # with or without the deleted document's v1 (the erase's)
    assert emptied((await versions(pool, docs.served.document_id))[1])
    left = await versions(pool, docs.deleted.document_id)
    assert [(v.content, v.chunks) for v in left.values()] == [(b"", 0), (b"", 0)]
    # The racing document's v1 task was running: the delete ended it (DEAD), so the pass's
    # later batches found v1 superseded and finished, and emptied it; v2, the document's
    # last published version (its tombstone's), stays.
    racing = await versions(pool, docs.racing.document_id)
    assert emptied(racing[1])
    assert intact(racing[2])


_KILLED_PASS = """
import asyncio, sys
from datetime import datetime
import asyncpg
from services.indexer.gc.retention import RetentionCollector
from services.indexer.gc.settings import RetentionSettings

async def main() -> None:
    pool = await asyncpg.create_pool(sys.argv[1], min_size=1, max_size=1)
    settings = RetentionSettings(superseded_days=30, batch_versions=1, batch_rows=2)
    collector = RetentionCollector(pool, settings)
    await collector.collect(now=datetime.fromisoformat(sys.argv[2]))

asyncio.run(main())
"""


async def test_a_collector_killed_mid_pass_loses_nothing_and_a_rerun_finishes(
    pool: asyncpg.Pool[Any], database_url: str
) -> None:
    docs = await corpus(pool)
    late = await db_time(pool, DAYS + 1)
    before = await versions(pool, docs.deleted.document_id)
    # The served document's v1 (5 chunks) is taken first (superseded first); its batches of
    # 2 rows commit one by one. The deleted document's v1 comes next: its task is held here,
    # so the pass stops inside that batch's transaction, and is killed there.
    async with pool.acquire() as holder:
        tx = holder.transaction()
        await tx.start()
        await holder.execute(
            "SELECT 1 FROM index_task WHERE task_id = $1 FOR UPDATE", docs.deleted.task_id
        )
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            _KILLED_PASS,
            database_url,
            late.isoformat(),
            cwd=REPO_ROOT,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        )
        try:
            await wait_until_blocked_on_a_lock(pool)
            orphan = await pool.fetchval(
                "SELECT pid FROM pg_stat_activity"
                " WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
            process.send_signal(signal.SIGKILL)
            assert await process.wait() == -signal.SIGKILL
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
        # The killed pass's backend still waits for this lock, its client gone: its
        # transaction can only roll back. Free the lock and wait for it to end.
        await tx.rollback()
    await pool.execute(
        "SELECT pg_terminate_backend(pid, 30000) FROM pg_stat_activity WHERE pid = $1", orphan
    )
    assert not await pool.fetchval("SELECT count(*) FROM pg_stat_activity WHERE pid = $1", orphan)

    # What committed before the kill is whole: the first version emptied; the one being
    # worked on untouched (its batch never committed); no version half-removed.
    assert emptied((await versions(pool, docs.served.document_id))[1])
    assert await versions(pool, docs.deleted.document_id) == before
    assert not await pool.fetchval(
        """SELECT count(*) FROM document_version v
            WHERE v.content_removed_at IS NOT NULL
              AND (v.content <> ''::bytea OR EXISTS (
                   SELECT 1 FROM knowledge_chunk c WHERE c.document_id = v.document_id
                      AND c.version_number = v.version_number))"""
    )

    done = await retention(pool, batch_versions=1, batch_rows=2).collect(now=late)
    assert done == RetentionPass(1, before[1].size_bytes, before[1].chunks)
    assert emptied((await versions(pool, docs.deleted.document_id))[1])
    assert intact((await versions(pool, docs.deleted.document_id))[2])


async def test_kb_index_retention_removes_what_is_due_by_the_database_clock(
    pool: asyncpg.Pool[Any], service_env: dict[str, str]
) -> None:
    """The command's pass, with the period from KB_RETENTION_SUPERSEDED_DAYS: v1 was
    superseded by a publish 40 days ago (by the database's clock), so 30 days remove it and
    50 keep it."""
    created = await create_task(pool)
    await supersede_40_days_ago(pool, created)
    kept = kb({**service_env, "KB_RETENTION_SUPERSEDED_DAYS": "50"}, "index", "retention")
    assert kept.returncode == 0, kept.stderr
    assert "0 versions' content removed" in kept.stderr
    removed = kb({**service_env, "KB_RETENTION_SUPERSEDED_DAYS": "30"}, "index", "retention")
    assert removed.returncode == 0, removed.stderr
    size = (await versions(pool, created.document_id))[1].size_bytes
    assert f"1 versions' content removed ({size} bytes, 0 chunks), keeping 30 days" in (
        removed.stderr
    )
    assert emptied((await versions(pool, created.document_id))[1])
    assert intact((await versions(pool, created.document_id))[2])
    refused = kb({**service_env, "KB_RETENTION_SUPERSEDED_DAYS": "-1"}, "index", "retention")
    assert refused.returncode == 2
