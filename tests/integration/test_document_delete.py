"""Deleting a document (docs/architecture.md#document-lifecycle), on real PostgreSQL: one
transaction takes it out of search (the pointer moves forward to a tombstone), drops its
served ACL, ends its unfinished tasks and writes a DocumentDeleted event; a completion
after it writes nothing (DOCUMENT_DELETED); the delete is idempotent, refuses a stale
revision, shows in the status and is final (a publish afterwards is refused)."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import numpy as np
import pytest

from services.index.generation import IndexGeneration
from services.indexer.ports import IndexingOutcome
from services.indexer.queue.store_pg import PgTaskQueue
from services.indexer.queue.worker import RunOnceResult, Worker
from services.indexer.retry import RetryPolicy
from services.indexer.sink.pgvector import PgVectorSink
from services.indexer.task import Lease
from services.relay.outbox_pg import PgOutboxSource, create_relay_pool
from services.relay.ports import ReplayFilter
from services.relay.replay import replay
from services.relay.sink_kafka import KafkaSink
from services.runtime.messaging.avro import default_registry
from services.runtime.settings import RuntimeSettings
from tests.support import versions
from tests.support.api import (
    ApiTenant,
    Harness,
    add_tenant,
    publish,
    publisher_harness,
    snapshot,
    upload,
)
from tests.support.cli import kb
from tests.support.kafka import TopicReader, relay_settings, relay_topics, running_relay
from tests.support.locks import wait_until_blocked_on_a_lock
from tests.support.paused import PausedWrite
from tests.support.pipeline import running_pipeline
from tests.support.search import STRATEGY, SearchHarness, search_harness

pytestmark = pytest.mark.integration

TEXT = b"Refunds: customers may return goods within thirty days for a full refund."
QUERY = "refund return goods thirty days"


@pytest.fixture
async def api(settings: RuntimeSettings) -> AsyncIterator[SearchHarness]:
    async with search_harness(settings) as harness:
        yield harness


@pytest.fixture
async def bulk_api(settings: RuntimeSettings) -> AsyncIterator[Harness]:
    """The publisher's app with bulk publishing wired (search_harness has none)."""
    async with publisher_harness(settings) as harness:
        yield harness


@pytest.fixture
async def acme(conn: asyncpg.Connection[Any]) -> ApiTenant:
    return await add_tenant(conn, "acme", "standard")


def worker(pool: asyncpg.Pool[Any], indexer: Any) -> Worker:
    return Worker(
        PgTaskQueue(pool),
        indexer,
        tier="standard",
        owner="it-document-delete",
        policy=RetryPolicy(jitter=0),
    )


async def published(
    api: SearchHarness | Harness, tenant: ApiTenant, content: bytes = TEXT
) -> tuple[str, int]:
    """A new document with version 1 published; its id and revision."""
    response = await upload(api.client, tenant, content)
    assert response.status_code == 201, response.text
    document_id = response.json()["documentId"]
    response = await publish(api.client, tenant, document_id, 1, 1, read=["group:all"])
    assert response.status_code == 202, response.text
    return document_id, response.json()["revision"]


async def delete(
    api: SearchHarness | Harness, tenant: ApiTenant, document_id: str, revision: Any
) -> Any:
    return await api.client.delete(
        tenant.path(f"/documents/{document_id}"),
        params={"revision": revision},
        headers=tenant.headers,
    )


async def found(api: SearchHarness, tenant: ApiTenant, after: list[str] | None = None) -> set[str]:
    """The documents a search returns, in every mode."""
    documents: set[str] = set()
    for mode in ("hybrid", "vector", "keyword"):
        body: dict[str, Any] = {"query": QUERY, "principals": ["group:all"], "mode": mode}
        if after is not None:
            body["after"] = after
        response = await api.search(tenant, body)
        assert response.status_code == 200, response.text
        documents |= {r["documentId"] for r in response.json()["results"]}
    return documents


async def status(api: SearchHarness, tenant: ApiTenant, document_id: str) -> Any:
    response = await api.client.get(
        tenant.path(f"/documents/{document_id}"), headers=tenant.headers
    )
    assert response.status_code == 200, response.text
    return response.json()


async def test_a_delete_takes_the_document_out_of_search_in_one_transaction(
    api: SearchHarness, acme: ApiTenant, pool: asyncpg.Pool[Any], conn: asyncpg.Connection[Any]
) -> None:
    document_id, revision = await published(api, acme)
    other_id, _ = await published(api, acme, TEXT + b" Other shop.")
    async with running_pipeline(pool) as indexer:
        assert await worker(pool, indexer).run_once() is RunOnceResult.SUCCEEDED
        assert await worker(pool, indexer).run_once() is RunOnceResult.SUCCEEDED
    assert await found(api, acme) == {document_id, other_id}
    doc = uuid.UUID(document_id)
    chunks = await conn.fetchval("SELECT count(*) FROM knowledge_chunk WHERE document_id = $1", doc)
    assert chunks > 0

    response = await delete(api, acme, document_id, revision)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["documentId"] == document_id
    assert body["revision"] == revision + 1
    assert body["deletedAt"] is not None
    assert body["searchToken"]

    # Gone from every search mode at once; the other document stays.
    assert await found(api, acme) == {other_id}
    assert await found(api, acme, after=[body["searchToken"]]) == {other_id}
    pointer = await conn.fetchrow(
        "SELECT * FROM document_search_version WHERE document_id = $1", doc
    )
    assert pointer is not None
    assert pointer["deleted_at"] is not None
    assert (pointer["version_number"], pointer["chunking_strategy"], pointer["chunk_count"]) == (
        1,
        None,
        0,
    )
    # Its ACL no longer applies: no served ACL row is left to match a principal.
    assert await conn.fetchval("SELECT count(*) FROM document_acl WHERE document_id = $1", doc) == 0
    row = await conn.fetchrow(
        "SELECT revision, deleted_at FROM document WHERE document_id = $1", doc
    )
    assert row is not None
    assert row["revision"] == revision + 1
    assert row["deleted_at"] == pointer["deleted_at"]  # one transaction, one now()

    events = await conn.fetch(
        "SELECT event_type, payload FROM outbox WHERE aggregate_key = $1 ORDER BY position",
        f"acme/{document_id}",
    )
    assert [e["event_type"] for e in events][-1] == "DocumentDeleted"
    decoded = default_registry().decode(bytes(events[-1]["payload"])).record
    assert decoded["documentId"] == doc
    assert decoded["revision"] == revision + 1
    assert decoded["previousSearchVersion"] == 1
    assert decoded["cancelledTasks"] == 0
    assert "title" not in decoded  # ids and numbers only: no content reaches Kafka


async def test_a_delete_ends_the_documents_unfinished_tasks(
    api: SearchHarness, acme: ApiTenant, pool: asyncpg.Pool[Any], conn: asyncpg.Connection[Any]
) -> None:
    document_id, revision = await published(api, acme)
    task_id = await conn.fetchval(
        "SELECT task_id FROM index_task WHERE document_id = $1", uuid.UUID(document_id)
    )
    response = await delete(api, acme, document_id, revision)
    assert response.status_code == 200, response.text
    task = await conn.fetchrow("SELECT * FROM index_task WHERE task_id = $1", task_id)
    assert task is not None
    assert (task["status"], task["error_code"]) == ("DEAD", "DOCUMENT_DELETED")
    assert task["finished_at"] is not None
    # A never-served document gets its first pointer as a tombstone.
    pointer = await conn.fetchrow(
        "SELECT * FROM document_search_version WHERE document_id = $1", uuid.UUID(document_id)
    )
    assert pointer is not None
    assert pointer["deleted_at"] is not None
    decoded = (
        default_registry()
        .decode(
            bytes(
                await conn.fetchval(
                    "SELECT payload FROM outbox WHERE event_type = 'DocumentDeleted'"
                    " AND aggregate_key = $1",
                    f"acme/{document_id}",
                )
            )
        )
        .record
    )
    assert decoded["cancelledTasks"] == 1
    assert decoded["previousSearchVersion"] is None
    # Nothing is left to claim.
    async with running_pipeline(pool) as indexer:
        assert await worker(pool, indexer).run_once() is RunOnceResult.IDLE
    # The task's view says why, with its fixed text.
    response = await api.client.get(acme.path(f"/index-tasks/{task_id}"), headers=acme.headers)
    assert response.status_code == 200
    assert response.json()["errorCode"] == "DOCUMENT_DELETED"


async def test_deleting_again_answers_the_same_and_writes_nothing(
    api: SearchHarness, acme: ApiTenant, conn: asyncpg.Connection[Any]
) -> None:
    document_id, revision = await published(api, acme)
    first = await delete(api, acme, document_id, revision)
    assert first.status_code == 200, first.text
    outbox = await conn.fetchval("SELECT count(*) FROM outbox")
    # A retry carries the revision the client had (now stale) or the new one: same answer.
    for again_revision in (revision, revision + 1, 999):
        again = await delete(api, acme, document_id, again_revision)
        assert again.status_code == 200, again.text
        body, was = again.json(), first.json()
        assert (body["revision"], body["deletedAt"]) == (was["revision"], was["deletedAt"])
    assert await conn.fetchval("SELECT count(*) FROM outbox") == outbox
    assert (
        await conn.fetchval(
            "SELECT revision FROM document WHERE document_id = $1", uuid.UUID(document_id)
        )
        == revision + 1
    )
    registry = api.app.state.metrics.registry

    def counted(result: str) -> float | None:
        return registry.get_sample_value(  # type: ignore[no-any-return]
            "kb_publisher_operations_total",
            {"operation": "delete_document", "result": result},
        )

    assert (counted("ok"), counted("unchanged")) == (1, 3)


async def test_a_stale_revision_is_refused_and_changes_nothing(
    api: SearchHarness, acme: ApiTenant, pool: asyncpg.Pool[Any], conn: asyncpg.Connection[Any]
) -> None:
    document_id, revision = await published(api, acme)
    async with running_pipeline(pool) as indexer:
        assert await worker(pool, indexer).run_once() is RunOnceResult.SUCCEEDED
    before = await conn.fetch(
        "SELECT * FROM document_search_version WHERE document_id = $1", uuid.UUID(document_id)
    )
    tables = await snapshot(conn)
    response = await delete(api, acme, document_id, revision - 1)
    assert response.status_code == 409
    assert response.headers["content-type"].startswith("application/problem+json")
    problem = response.json()
    assert problem["errorCode"] == "REVISION_CONFLICT"
    assert problem["currentRevision"] == revision
    assert await found(api, acme) == {document_id}
    after = await conn.fetch(
        "SELECT * FROM document_search_version WHERE document_id = $1", uuid.UUID(document_id)
    )
    assert after == before
    assert await snapshot(conn) == tables


@pytest.mark.parametrize("revision", ["0", "x", "-1", "9223372036854775808"])
async def test_a_bad_revision_is_refused(
    api: SearchHarness, acme: ApiTenant, conn: asyncpg.Connection[Any], revision: str
) -> None:
    document_id, _ = await published(api, acme)
    tables = await snapshot(conn)
    response = await delete(api, acme, document_id, revision)
    assert response.status_code in (400, 422), response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    missing = await api.client.delete(acme.path(f"/documents/{document_id}"), headers=acme.headers)
    assert missing.status_code in (400, 422)
    assert await snapshot(conn) == tables
    assert (await status(api, acme, document_id))["indexStatus"] != "DELETED"


async def test_an_unknown_document_is_404(api: SearchHarness, acme: ApiTenant) -> None:
    response = await delete(api, acme, str(uuid.uuid4()), 1)
    assert response.status_code == 404
    assert response.json()["errorCode"] == "DOCUMENT_NOT_FOUND"


async def test_the_status_says_deleted_with_when(
    api: SearchHarness, acme: ApiTenant, pool: asyncpg.Pool[Any]
) -> None:
    document_id, revision = await published(api, acme)
    async with running_pipeline(pool) as indexer:
        assert await worker(pool, indexer).run_once() is RunOnceResult.SUCCEEDED
    assert (await status(api, acme, document_id))["indexStatus"] == "SEARCHABLE"
    deleted = (await delete(api, acme, document_id, revision)).json()
    seen = await status(api, acme, document_id)
    assert seen["indexStatus"] == "DELETED"
    assert seen["deletedAt"] == deleted["deletedAt"]
    assert seen["revision"] == deleted["revision"]
    assert seen["searchVersion"] is None
    assert seen["failure"] is None
    assert seen["searchToken"]


async def test_a_deleted_document_takes_no_new_version_or_publish(
    api: SearchHarness, acme: ApiTenant, conn: asyncpg.Connection[Any]
) -> None:
    document_id, revision = await published(api, acme)
    deleted = (await delete(api, acme, document_id, revision)).json()
    tasks = await conn.fetchval("SELECT count(*) FROM index_task")
    response = await publish(api.client, acme, document_id, 1, deleted["revision"])
    assert response.status_code == 409
    assert response.json()["errorCode"] == "DOCUMENT_DELETED"
    response = await upload(api.client, acme, b"A new text.", document_id=document_id)
    assert response.status_code == 409
    assert response.json()["errorCode"] == "DOCUMENT_DELETED"
    assert await conn.fetchval("SELECT count(*) FROM index_task") == tasks
    assert (
        await conn.fetchval(
            "SELECT latest_version FROM document WHERE document_id = $1", uuid.UUID(document_id)
        )
        == 1
    )


class GatedIndexer:
    """The real pipeline, holding its result until ``release``: the task is RUNNING under
    its lease, its chunks computed, when ``reached`` is set."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.reached = asyncio.Event()
        self.release = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def index(self, lease: Lease) -> IndexingOutcome:
        outcome: IndexingOutcome = await self.inner.index(lease)
        self.reached.set()
        await self.release.wait()
        return outcome


async def test_a_task_running_when_the_delete_commits_writes_nothing(
    api: SearchHarness, acme: ApiTenant, pool: asyncpg.Pool[Any], conn: asyncpg.Connection[Any]
) -> None:
    document_id, revision = await published(api, acme)
    doc = uuid.UUID(document_id)
    async with running_pipeline(pool) as indexer:
        gated = GatedIndexer(indexer)
        run = asyncio.create_task(worker(pool, gated).run_once())
        await gated.reached.wait()
        assert await conn.fetchval("SELECT status FROM index_task WHERE document_id = $1", doc) == (
            "RUNNING"
        )
        response = await delete(api, acme, document_id, revision)
        assert response.status_code == 200, response.text
        gated.release.set()
        # The delete ended the task: its completion's fence refuses it, as a lost lease's.
        assert await run is RunOnceResult.LOST_LEASE
    assert (
        await conn.fetchval("SELECT count(*) FROM knowledge_chunk WHERE document_id = $1", doc) == 0
    )
    assert (
        await conn.fetchval(
            "SELECT count(*) FROM document_generation_version WHERE document_id = $1", doc
        )
        == 0
    )
    task = await conn.fetchrow(
        "SELECT status, error_code FROM index_task WHERE document_id = $1", doc
    )
    assert task is not None
    assert (task["status"], task["error_code"]) == ("DEAD", "DOCUMENT_DELETED")
    assert (
        await conn.fetchval(
            "SELECT count(*) FROM outbox WHERE event_type = 'DocumentSearchVersionSwitched'"
        )
        == 0
    )
    assert (await status(api, acme, document_id))["indexStatus"] == "DELETED"
    assert await found(api, acme) == set()


async def test_a_task_run_after_the_delete_is_fenced_by_the_tombstone(
    api: SearchHarness, acme: ApiTenant, pool: asyncpg.Pool[Any], conn: asyncpg.Connection[Any]
) -> None:
    """An operator's requeue (or a repair's re-run) after the delete: the task runs, and its
    completion finds the tombstone: nothing written, DEAD with DOCUMENT_DELETED, no retry."""
    document_id, revision = await published(api, acme)
    doc = uuid.UUID(document_id)
    task_id = await conn.fetchval("SELECT task_id FROM index_task WHERE document_id = $1", doc)
    assert (await delete(api, acme, document_id, revision)).status_code == 200
    queue = PgTaskQueue(pool)
    await queue.requeue(task_id, by="it", reset_attempts=True, budget=8)
    async with running_pipeline(pool) as indexer:
        assert await worker(pool, indexer).run_once() is RunOnceResult.FAILED
        # Terminal: nothing left to claim, no retry.
        assert await worker(pool, indexer).run_once() is RunOnceResult.IDLE
    task = await conn.fetchrow("SELECT * FROM index_task WHERE task_id = $1", task_id)
    assert task is not None
    assert (task["status"], task["error_code"]) == ("DEAD", "DOCUMENT_DELETED")
    assert (
        await conn.fetchval("SELECT count(*) FROM knowledge_chunk WHERE document_id = $1", doc) == 0
    )
    assert (
        await conn.fetchval(
            "SELECT count(*) FROM document_generation_version WHERE document_id = $1", doc
        )
        == 0
    )
    pointer = await conn.fetchrow(
        "SELECT * FROM document_search_version WHERE document_id = $1", doc
    )
    assert pointer is not None
    assert pointer["deleted_at"] is not None
    assert pointer["chunking_strategy"] is None
    assert await found(api, acme) == set()


async def test_the_tombstone_is_final_for_every_writer(
    api: SearchHarness, acme: ApiTenant, conn: asyncpg.Connection[Any]
) -> None:
    """Migration 0030's triggers: no UPDATE or DELETE of a tombstone, no clearing of the
    document's deletion, whoever tries (a script, a switch, a restore tool)."""
    document_id, revision = await published(api, acme)
    assert (await delete(api, acme, document_id, revision)).status_code == 200
    doc = uuid.UUID(document_id)
    for statement in (
        "UPDATE document_search_version SET deleted_at = NULL WHERE document_id = $1",
        "UPDATE document_search_version SET chunking_strategy = 'x', chunk_count = 1"
        " WHERE document_id = $1",
        "DELETE FROM document_search_version WHERE document_id = $1",
    ):
        with pytest.raises(asyncpg.CheckViolationError, match="tombstone"):
            await conn.execute(statement, doc)
    with pytest.raises(asyncpg.CheckViolationError, match="final"):
        await conn.execute("UPDATE document SET deleted_at = NULL WHERE document_id = $1", doc)


async def bulk(api: Harness, tenant: ApiTenant, items: list[Any], files: list[bytes]) -> Any:
    parts: list[Any] = [("items", (None, json.dumps(items).encode(), "application/json"))]
    parts += [("file", (f"f{n}.txt", content, "text/plain")) for n, content in enumerate(files)]
    return await api.client.post(
        tenant.path("/documents/bulk"), files=parts, headers=tenant.headers
    )


async def test_bulk_delete_items_are_deleted_and_refused_alone(
    bulk_api: Harness, acme: ApiTenant, conn: asyncpg.Connection[Any]
) -> None:
    api = bulk_api
    kept_id, _ = await published(api, acme)
    gone_id, gone_revision = await published(api, acme)
    stale_id, stale_revision = await published(api, acme)
    response = await bulk(
        api,
        acme,
        [
            {"documentId": gone_id, "delete": True, "revision": gone_revision},
            {"title": "New", "acl": {"read": ["group:all"]}},
            {"documentId": stale_id, "delete": True, "revision": stale_revision - 1},
            {"documentId": str(uuid.uuid4()), "delete": True, "revision": 1},
            {"documentId": kept_id, "acl": {"read": ["group:all"]}},
        ],
        [b"A new document.", b"A new version."],
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert (body["published"], body["deleted"], body["refused"]) == (2, 1, 2)
    results = body["results"]
    assert results[0]["status"] == 200
    assert results[0]["documentId"] == gone_id
    assert results[0]["revision"] == gone_revision + 1
    assert results[0]["deletedAt"] is not None
    assert (results[2]["status"], results[2]["errorCode"]) == (409, "REVISION_CONFLICT")
    assert (results[3]["status"], results[3]["errorCode"]) == (404, "DOCUMENT_NOT_FOUND")
    assert results[1]["status"] == results[4]["status"] == 202
    deleted = {
        str(row["document_id"])
        for row in await conn.fetch("SELECT document_id FROM document WHERE deleted_at IS NOT NULL")
    }
    assert deleted == {gone_id}
    assert (
        await conn.fetchval("SELECT count(*) FROM outbox WHERE event_type = 'DocumentDeleted'") == 1
    )
    # A publish item naming a deleted document is refused alone, as the single call is.
    again = await bulk(
        api, acme, [{"documentId": gone_id, "acl": {"read": ["group:all"]}}], [b"Back?"]
    )
    assert again.status_code == 200, again.text
    assert again.json()["results"][0]["errorCode"] == "DOCUMENT_DELETED"


@pytest.mark.parametrize(
    "item",
    [
        {"documentId": "00000000-0000-0000-0000-000000000001", "delete": True},
        {"delete": True, "revision": 1},
        {
            "documentId": "00000000-0000-0000-0000-000000000001",
            "delete": True,
            "revision": 1,
            "acl": {"read": []},
        },
        {"documentId": "00000000-0000-0000-0000-000000000001", "delete": True, "revision": "1"},
        {"title": "T", "acl": {"read": []}, "revision": 1},
    ],
)
async def test_an_unreadable_delete_item_refuses_the_request(
    bulk_api: Harness, acme: ApiTenant, conn: asyncpg.Connection[Any], item: dict[str, Any]
) -> None:
    api = bulk_api
    files = [] if item.get("delete") else [b"text"]
    response = await bulk(api, acme, [item], files)
    assert response.status_code == 400, response.text
    assert response.json()["errorCode"] == "BULK_INVALID"
    assert await conn.fetchval("SELECT count(*) FROM document") == 0


async def test_a_delete_item_takes_no_file(
    bulk_api: Harness, acme: ApiTenant, conn: asyncpg.Connection[Any]
) -> None:
    api = bulk_api
    document_id, revision = await published(api, acme)
    item = {"documentId": document_id, "delete": True, "revision": revision}
    response = await bulk(api, acme, [item], [b"a file for nobody"])
    assert response.status_code == 400, response.text
    assert response.json()["errorCode"] == "BULK_INVALID"
    assert await conn.fetchval("SELECT count(*) FROM document WHERE deleted_at IS NOT NULL") == 0


async def test_the_event_reaches_kafka_and_a_replay_resurrects_nothing(
    api: SearchHarness,
    acme: ApiTenant,
    settings: RuntimeSettings,
    pool: asyncpg.Pool[Any],
    conn: asyncpg.Connection[Any],
) -> None:
    document_id, revision = await published(api, acme)
    async with running_pipeline(pool) as indexer:
        assert await worker(pool, indexer).run_once() is RunOnceResult.SUCCEEDED
    deleted = await delete(api, acme, document_id, revision)
    assert deleted.status_code == 200, deleted.text
    event_id = await conn.fetchval(
        "SELECT event_id FROM outbox WHERE event_type = 'DocumentDeleted' AND aggregate_key = $1",
        f"acme/{document_id}",
    )
    s = relay_settings(settings)
    async with TopicReader(s.kafka_bootstrap_servers, relay_topics(s)) as reader:
        async with running_relay(s):
            await reader.read_event_ids([event_id])
        message = next(m for m in reader.messages if m.event_id == event_id)
        assert message.topic == s.topic("kb.document-events")
        assert message.key == f"acme/{document_id}"
        assert message.headers["event_type"] == "DocumentDeleted"
        record = default_registry().decode(message.value).record
        assert record["documentId"] == uuid.UUID(document_id)
        assert record["revision"] == revision + 1
        assert TEXT.decode() not in message.value.decode("utf-8", "replace")

        # Every event of the document again (its publish, its task, its switch, its
        # delete): Kafka gets them, the database is not moved back by any of them.
        relay_pool = await create_relay_pool(s)
        sink = KafkaSink(s, client_id="it-delete-replay")
        try:
            await sink.start()
            result = await replay(PgOutboxSource(relay_pool), sink, ReplayFilter(tenant_id="acme"))
        finally:
            await sink.stop()
            await relay_pool.close()
        assert result.sent >= 4
    async with running_pipeline(pool) as indexer:
        assert await worker(pool, indexer).run_once() is RunOnceResult.IDLE
    assert (await status(api, acme, document_id))["indexStatus"] == "DELETED"
    assert await found(api, acme) == set()


async def test_kb_documents_delete(
    api: SearchHarness, acme: ApiTenant, service_env: dict[str, str], conn: asyncpg.Connection[Any]
) -> None:
    document_id, revision = await published(api, acme)
    stale = kb(service_env, "documents", "delete", "acme", document_id, "--revision", "1")
    assert stale.returncode == 1
    assert "REVISION_CONFLICT" in stale.stderr
    result = kb(
        service_env, "documents", "delete", "acme", document_id, "--revision", str(revision)
    )
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    assert answer["documentId"] == document_id
    assert answer["revision"] == revision + 1
    assert answer["searchToken"]
    assert (await status(api, acme, document_id))["indexStatus"] == "DELETED"
    # Again: the same answer, nothing written.
    again = kb(service_env, "documents", "delete", "acme", document_id, "--revision", "1")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["deletedAt"] == answer["deletedAt"]
    assert (
        await conn.fetchval("SELECT count(*) FROM outbox WHERE event_type = 'DocumentDeleted'") == 1
    )


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["acme", "not-a-uuid", "--revision", "2"], "DOCUMENT_ID_INVALID"),
        (["Acme Corp", str(uuid.uuid4()), "--revision", "2"], "TENANT_NAME_INVALID"),
        (["acme", str(uuid.uuid4()), "--revision", "2"], "DOCUMENT_NOT_FOUND"),
        (["acme", str(uuid.uuid4()), "--revision", "0"], "--revision"),
        (["acme", str(uuid.uuid4())], "--revision"),
    ],
)
async def test_kb_documents_delete_exits_2_on_bad_input(
    acme: ApiTenant,
    service_env: dict[str, str],
    conn: asyncpg.Connection[Any],
    args: list[str],
    said: str,
) -> None:
    result = kb(service_env, "documents", "delete", *args)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert said in result.stderr
    assert result.stdout == ""
    assert await conn.fetchval("SELECT count(*) FROM outbox") == 0


async def test_a_delete_waits_for_a_completion_holding_its_fence_then_takes_it_out(
    api: SearchHarness, acme: ApiTenant, pool: asyncpg.Pool[Any], conn: asyncpg.Connection[Any]
) -> None:
    """The other order of the race: the completion's fence passed and its write is done but
    not committed when the delete comes. The delete waits for the task row (the lock order
    of a publish), the completion commits SUCCEEDED, and the delete then moves the pointer
    the completion switched forward to a tombstone: the document is out of search."""
    document_id, revision = await published(api, acme)
    doc = uuid.UUID(document_id)
    generation = IndexGeneration("test-delete-8", 8, STRATEGY)
    sink = PgVectorSink(pool)
    await sink.ensure_generation(generation)
    queue = PgTaskQueue(pool)
    (lease,) = await queue.claim("standard", "it-writer", lease_seconds=60)
    chunks = versions.make_chunks(doc, 1, ["refund within thirty days"], STRATEGY)
    vectors = np.ones((1, 8), dtype=np.float32) / np.sqrt(8)
    paused = PausedWrite(sink.writer(lease, generation, chunks, vectors))
    completing = asyncio.create_task(queue.complete(lease, in_transaction=paused))
    await paused.reached.wait()
    deleting = asyncio.create_task(delete(api, acme, document_id, revision))
    await wait_until_blocked_on_a_lock(conn)
    assert not deleting.done()
    paused.release.set()
    await completing
    response = await deleting
    assert response.status_code == 200, response.text
    task = await conn.fetchrow(
        "SELECT status, error_code FROM index_task WHERE document_id = $1", doc
    )
    assert task is not None
    assert (task["status"], task["error_code"]) == ("SUCCEEDED", None)
    pointer = await conn.fetchrow(
        "SELECT version_number, chunking_strategy, deleted_at FROM document_search_version"
        " WHERE document_id = $1",
        doc,
    )
    assert pointer is not None
    assert pointer["deleted_at"] is not None
    assert pointer["chunking_strategy"] is None
    payload = await conn.fetchval(
        "SELECT payload FROM outbox WHERE event_type = 'DocumentDeleted' AND aggregate_key = $1",
        f"acme/{document_id}",
    )
    record = default_registry().decode(bytes(payload)).record
    # The completion's switch came first: the delete saw the version it served.
    assert (record["previousSearchVersion"], record["cancelledTasks"]) == (1, 0)
    assert await found(api, acme) == set()


async def test_a_running_streamed_task_s_staged_slices_go_with_the_delete(
    api: SearchHarness, acme: ApiTenant, pool: asyncpg.Pool[Any], conn: asyncpg.Connection[Any]
) -> None:
    """A large document is staged slice by slice before its completion moves the slices in;
    the delete ends the task, and its staged slices (their text included) go in the same
    transaction: no later attempt would ever delete them."""
    content = b"\n\n".join(TEXT + f" Clause {n}.".encode() for n in range(40))
    document_id, revision = await published(api, acme, content)
    task_id = await conn.fetchval(
        "SELECT task_id FROM index_task WHERE document_id = $1", uuid.UUID(document_id)
    )
    async with running_pipeline(
        pool, max_tokens=16, slice_chunks=2, stream_above_chunks=0
    ) as indexer:
        gated = GatedIndexer(indexer)
        run = asyncio.create_task(worker(pool, gated).run_once())
        await gated.reached.wait()
        staged = "SELECT count(*) FROM knowledge_chunk_stream WHERE task_id = $1"
        assert await conn.fetchval(staged, task_id) > 0
        response = await delete(api, acme, document_id, revision)
        assert response.status_code == 200, response.text
        assert await conn.fetchval(staged, task_id) == 0
        gated.release.set()
        assert await run is RunOnceResult.LOST_LEASE
    assert await conn.fetchval(staged, task_id) == 0
    assert (
        await conn.fetchval(
            "SELECT count(*) FROM knowledge_chunk WHERE document_id = $1", uuid.UUID(document_id)
        )
        == 0
    )


async def test_a_repair_re_run_after_the_delete_writes_nothing(
    api: SearchHarness, acme: ApiTenant, pool: asyncpg.Pool[Any], conn: asyncpg.Connection[Any]
) -> None:
    """`kb index check --repair` re-runs a SUCCEEDED task (rerun_succeeded); after a delete
    the re-run reaches the sink and is refused there: the chunks the document had are not
    rewritten, the tombstone stays, the task ends DEAD with DOCUMENT_DELETED."""
    document_id, revision = await published(api, acme)
    doc = uuid.UUID(document_id)
    async with running_pipeline(pool) as indexer:
        assert await worker(pool, indexer).run_once() is RunOnceResult.SUCCEEDED
        task_id = await conn.fetchval("SELECT task_id FROM index_task WHERE document_id = $1", doc)
        assert (await delete(api, acme, document_id, revision)).status_code == 200
        chunks = await conn.fetch(
            "SELECT chunk_id, xmin::text FROM knowledge_chunk WHERE document_id = $1 ORDER BY 1",
            doc,
        )
        queue = PgTaskQueue(pool)
        rerun = await queue.rerun_succeeded(
            task_id, by="it-repair", budget=8, reason=("CHUNKS_MISSING", "it")
        )
        assert rerun is not None
        assert await worker(pool, indexer).run_once() is RunOnceResult.FAILED
        assert await worker(pool, indexer).run_once() is RunOnceResult.IDLE
    task = await conn.fetchrow(
        "SELECT status, error_code FROM index_task WHERE task_id = $1", task_id
    )
    assert task is not None
    assert (task["status"], task["error_code"]) == ("DEAD", "DOCUMENT_DELETED")
    # Not one chunk rewritten (same rows, same writing transactions).
    assert (
        await conn.fetch(
            "SELECT chunk_id, xmin::text FROM knowledge_chunk WHERE document_id = $1 ORDER BY 1",
            doc,
        )
        == chunks
    )
    pointer = await conn.fetchrow(
        "SELECT chunking_strategy, deleted_at FROM document_search_version WHERE document_id = $1",
        doc,
    )
    assert pointer is not None
    assert (pointer["chunking_strategy"], pointer["deleted_at"] is not None) == (None, True)
    assert await found(api, acme) == set()
