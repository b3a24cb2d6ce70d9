"""Erasing a document (docs/architecture.md#document-lifecycle), on real PostgreSQL and
Kafka: erase implies delete; everything the system holds of the content goes (checked by a
pg_dump of the whole database: no byte of a unique marker is left); an audit row stays;
only an admin key may; it is idempotent, resumable after a failure between batches, runs in
bounded batches while another document is searched and published; the CLI; the events."""

from __future__ import annotations

import asyncio
import json
import subprocess
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from kbtools.devstack.postgres import pginstall_dir
from services.publisher.keys.store_pg import KeySpec, PgKeyStore
from services.publisher.ports import ErasureRequest
from services.runtime.auth.keys import Scope
from services.runtime.erasure.erase_pg import QUERIES as ERASE_QUERIES
from services.runtime.erasure.erase_pg import PgErasureStore
from services.runtime.messaging.avro import default_registry
from services.runtime.settings import RuntimeSettings
from services.runtime.tenancy.tenant_auth import hash_api_key, new_api_key
from tests.integration.test_document_delete import found, published, status, worker
from tests.support.api import ApiTenant, add_tenant, publish, upload
from tests.support.cli import kb
from tests.support.kafka import TopicReader, relay_settings, relay_topics, running_relay
from tests.support.locks import RowTaker
from tests.support.pipeline import running_pipeline
from tests.support.search import SearchHarness, search_harness

pytestmark = pytest.mark.integration


@pytest.fixture
async def api(settings: RuntimeSettings) -> AsyncIterator[SearchHarness]:
    async with search_harness(settings) as harness:
        yield harness


@pytest.fixture
async def acme(conn: asyncpg.Connection[Any]) -> ApiTenant:
    return await add_tenant(conn, "acme", "standard")


MARKER = "zqxmarker7741"


def marked_text(clauses: int = 1) -> bytes:
    return b"\n\n".join(
        f"Refunds: customers may return goods within thirty days {MARKER}. Clause {n}.".encode()
        for n in range(clauses)
    )


async def erase(api: SearchHarness, tenant: ApiTenant, document_id: str) -> Any:
    return await api.client.post(
        tenant.path(f"/documents/{document_id}/erase"), headers=tenant.headers
    )


async def indexed(
    api: SearchHarness, tenant: ApiTenant, pool: asyncpg.Pool[Any], content: bytes, **pipeline: Any
) -> tuple[str, int]:
    response = await upload(api.client, tenant, content, title=f"Policy {MARKER}")
    assert response.status_code == 201, response.text
    document_id = response.json()["documentId"]
    response = await publish(api.client, tenant, document_id, 1, 1, read=[f"user:{MARKER}"])
    assert response.status_code == 202, response.text
    async with running_pipeline(pool, **pipeline) as indexer:
        assert (await worker(pool, indexer).run_once()).name == "SUCCEEDED"
    return document_id, response.json()["revision"]


def pg_dump(database_url: str) -> bytes:
    """The whole database as pg_dump writes it (data, in plain SQL)."""
    result = subprocess.run(
        [str(pginstall_dir() / "bin" / "pg_dump"), "--dbname", database_url, "--no-owner"],
        capture_output=True,
        check=True,
        timeout=120,
    )
    return result.stdout


async def content_rows(conn: asyncpg.Connection[Any], document_id: str) -> dict[str, int]:
    doc = uuid.UUID(document_id)
    return {
        "chunks": await conn.fetchval(
            "SELECT count(*) FROM knowledge_chunk WHERE document_id = $1", doc
        ),
        "bytes": await conn.fetchval(
            "SELECT count(*) FROM document_version WHERE document_id = $1 AND content <> ''",
            doc,
        ),
        "version_acl": await conn.fetchval(
            "SELECT count(*) FROM document_version_acl WHERE document_id = $1", doc
        ),
    }


GONE = {"chunks": 0, "bytes": 0, "version_acl": 0}


async def test_an_erase_leaves_no_byte_of_the_content_in_a_pg_dump(
    api: SearchHarness,
    acme: ApiTenant,
    pool: asyncpg.Pool[Any],
    conn: asyncpg.Connection[Any],
    database_url: str,
) -> None:
    document_id, _ = await indexed(api, acme, pool, marked_text())
    other_id, _ = await published(api, acme)  # no marker: it stays, whole
    async with running_pipeline(pool) as indexer:
        assert (await worker(pool, indexer).run_once()).name == "SUCCEEDED"
    doc = uuid.UUID(document_id)
    # What else could hold the content: a task's error text quoting it, a requeue's copy of
    # it, a slice a crashed attempt left staged.
    task_id = await conn.fetchval("SELECT task_id FROM index_task WHERE document_id = $1", doc)
    await conn.execute(
        "UPDATE index_task SET error_code = 'EXTRACTION_FAILED', error_message = $2"
        " WHERE task_id = $1",
        task_id,
        f"cannot read {MARKER}",
    )
    await conn.execute(
        "INSERT INTO index_task_requeue (task_id, requeued_by, requeued_at, reset_attempts,"
        " attempts, previous_max_attempts, new_max_attempts, previous_error_message)"
        " VALUES ($1, 'ops', now(), false, 1, 8, 9, $2)",
        task_id,
        f"cannot read {MARKER}",
    )
    await conn.execute(
        "INSERT INTO knowledge_chunk_stream SELECT $1, 99, chunk_id, ordinal, heading_path,"
        " text, content_digest, embedding FROM knowledge_chunk WHERE document_id = $2",
        task_id,
        doc,
    )
    assert MARKER.encode() in pg_dump(database_url)

    response = await erase(api, acme, document_id)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["documentId"] == document_id
    assert body["erasedAt"] >= body["requestedAt"]
    assert body["deletedAt"]
    assert body["searchToken"]

    assert MARKER.encode() not in pg_dump(database_url)
    assert await content_rows(conn, document_id) == GONE
    # What remains: the audit row (tenant, document, when, which key), the tombstone, ids.
    audit = await conn.fetchrow("SELECT * FROM document_erasure WHERE document_id = $1", doc)
    assert audit is not None
    assert (audit["tenant_id"], audit["requested_by"]) == ("acme", "api")
    assert audit["key_id"] is not None
    assert audit["erased_at"] is not None
    task = await conn.fetchrow("SELECT * FROM index_task WHERE task_id = $1", task_id)
    assert task is not None
    assert (task["error_code"], task["error_message"]) == ("EXTRACTION_FAILED", None)
    versions = await conn.fetchrow(
        "SELECT sha256, size_bytes FROM document_version WHERE document_id = $1", doc
    )
    assert versions is not None
    assert versions["size_bytes"] > 0
    state = await status(api, acme, document_id)
    assert state["indexStatus"] == "DELETED"
    assert state["erasedAt"] is not None
    assert state["title"] == "(erased)"
    # The other document is whole and searchable.
    assert await content_rows(conn, other_id) != GONE
    assert await found(api, acme) == {other_id}


async def test_the_outbox_events_are_scrubbed_in_place_and_kafka_gets_no_content(
    api: SearchHarness,
    acme: ApiTenant,
    settings: RuntimeSettings,
    pool: asyncpg.Pool[Any],
    conn: asyncpg.Connection[Any],
) -> None:
    """Rewritten in place: every row keeps its position and txid, so the relay's windows
    deliver it where they always would (never skipped); its payload has no title and no
    principals, and it still decodes with the schema it was written with."""
    document_id, _ = await indexed(api, acme, pool, marked_text())
    key = f"acme/{document_id}"
    before = await conn.fetch(
        "SELECT position, txid, event_id, event_type FROM outbox WHERE aggregate_key = $1"
        " ORDER BY position",
        key,
    )
    response = await erase(api, acme, document_id)
    assert response.status_code == 200, response.text
    after = await conn.fetch(
        "SELECT position, txid, event_id, event_type, payload FROM outbox"
        " WHERE aggregate_key = $1 ORDER BY position",
        key,
    )
    # Nothing removed, nothing moved; the delete's event added after them.
    assert [tuple(r)[:4] for r in after][: len(before)] == [tuple(r) for r in before]
    assert after[-1]["event_type"] == "DocumentDeleted"
    published_events = [r for r in after if r["event_type"] == "DocumentVersionPublished"]
    assert published_events
    for row in published_events:
        record = default_registry().decode(bytes(row["payload"])).record
        assert (record["title"], record["readPrincipals"]) == ("(erased)", [])
    s = relay_settings(settings)
    ids = [r["event_id"] for r in after]
    async with TopicReader(s.kafka_bootstrap_servers, relay_topics(s)) as reader:
        async with running_relay(s):
            await reader.read_event_ids(ids)
        for message in reader.messages:
            if message.key == key:
                assert MARKER.encode() not in message.value


async def test_only_an_admin_key_may_erase(
    api: SearchHarness, acme: ApiTenant, pool: asyncpg.Pool[Any], conn: asyncpg.Connection[Any]
) -> None:
    document_id, _ = await indexed(api, acme, pool, marked_text())
    for scopes in ({Scope.PUBLISH}, {Scope.SEARCH}, {Scope.PUBLISH, Scope.SEARCH}):
        key = new_api_key("acme")
        await PgKeyStore(conn).create_key("acme", hash_api_key(key), KeySpec(frozenset(scopes)))
        response = await api.client.post(
            acme.path(f"/documents/{document_id}/erase"),
            headers={"Authorization": f"Bearer {key}"},
        )
        assert response.status_code == 403, response.text
        assert response.json()["errorCode"] == "KEY_SCOPE_INSUFFICIENT"
    # Nothing changed: not deleted, nothing erased, no audit row.
    assert (await status(api, acme, document_id))["indexStatus"] == "SEARCHABLE"
    assert await content_rows(conn, document_id) != GONE
    assert await conn.fetchval("SELECT count(*) FROM document_erasure") == 0


async def test_erasing_again_answers_the_same_and_writes_nothing(
    api: SearchHarness, acme: ApiTenant, pool: asyncpg.Pool[Any], conn: asyncpg.Connection[Any]
) -> None:
    document_id, _ = await indexed(api, acme, pool, marked_text())
    first = await erase(api, acme, document_id)
    assert first.status_code == 200, first.text
    outbox = await conn.fetch("SELECT position, payload FROM outbox ORDER BY position")
    again = await erase(api, acme, document_id)
    assert again.status_code == 200, again.text
    assert again.json()["erasedAt"] == first.json()["erasedAt"]
    assert again.json()["requestedAt"] == first.json()["requestedAt"]
    assert await conn.fetch("SELECT position, payload FROM outbox ORDER BY position") == outbox
    assert await conn.fetchval("SELECT count(*) FROM document_erasure") == 1


async def test_an_unknown_document_is_404_and_writes_nothing(
    api: SearchHarness, acme: ApiTenant, conn: asyncpg.Connection[Any]
) -> None:
    response = await erase(api, acme, str(uuid.uuid4()))
    assert response.status_code == 404, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    assert await conn.fetchval("SELECT count(*) FROM document_erasure") == 0


async def test_a_large_document_is_erased_in_batches_and_a_failure_between_them_resumes(
    api: SearchHarness, acme: ApiTenant, pool: asyncpg.Pool[Any], conn: asyncpg.Connection[Any]
) -> None:
    """Batches of 5 rows, each its own transaction: between two of them another document
    is searched and a new one published, without waiting; a failure injected after the
    second chunk batch leaves the erase in progress (the audit row without erased_at, some
    chunks left), and erasing again finishes it."""
    document_id, _ = await indexed(
        api, acme, pool, marked_text(40), max_tokens=16, slice_chunks=2, stream_above_chunks=0
    )
    other_id, _ = await published(api, acme)
    async with running_pipeline(pool) as indexer:
        assert (await worker(pool, indexer).run_once()).name == "SUCCEEDED"
    chunks = (await content_rows(conn, document_id))["chunks"]
    assert chunks > 20
    publisher = api.app.state.publisher
    publisher._erase_batch_rows = 5
    batches: list[str] = []

    class Interrupted(Exception):
        pass

    async def between(step: str) -> None:
        batches.append(step)
        if batches.count("chunks") == 1:
            # Mid-erase: search and publish of another document go on.
            assert await found(api, acme) == {other_id}
            response = await upload(api.client, acme, b"Shipping takes five days.")
            assert response.status_code == 201, response.text
        if batches.count("chunks") == 2:
            raise Interrupted

    # This one erase runs with the hook; the resumed one (over the API) without.
    serving, publisher._erasure = publisher._erasure, PgErasureStore(pool, between_batches=between)
    with pytest.raises(Interrupted):
        await publisher.erase_document(
            "acme", uuid.UUID(document_id), ErasureRequest(requested_by="cli")
        )
    publisher._erasure = serving
    audit = await conn.fetchrow("SELECT erased_at FROM document_erasure")
    assert audit is not None
    assert audit["erased_at"] is None
    assert (await content_rows(conn, document_id))["chunks"] == chunks - 10
    assert (await status(api, acme, document_id))["erasedAt"] is None

    resumed = await erase(api, acme, document_id)
    assert resumed.status_code == 200, resumed.text
    assert await content_rows(conn, document_id) == GONE
    assert (await status(api, acme, document_id))["erasedAt"] is not None
    assert batches.count("chunks") == 2


# Some of the next batch's rows, or all of them (the batch then removes nothing at all).
@pytest.mark.parametrize("taken", [3, 5], ids=["some", "all"])
async def test_a_concurrent_remover_does_not_end_a_step_early(
    taken: int,
    api: SearchHarness,
    acme: ApiTenant,
    pool: asyncpg.Pool[Any],
    conn: asyncpg.Connection[Any],
    database_url: str,
) -> None:
    """Another session (the collector, say) deletes rows of the batch being taken and
    commits while that batch waits for them: the batch removes fewer rows than asked though
    more are left, or none at all when every row it took is gone. The step goes on until a
    batch finds nothing of the step left, so the erase finishes."""
    document_id, _ = await indexed(
        api, acme, pool, marked_text(40), max_tokens=16, slice_chunks=2, stream_above_chunks=0
    )
    assert (await content_rows(conn, document_id))["chunks"] > 15
    publisher = api.app.state.publisher
    publisher._erase_batch_rows = 5
    async with RowTaker(database_url) as taker:

        async def between(step: str) -> None:
            if step != "chunks" or taker.took:
                return
            # The first rows of the next batch (of 5), deleted and not yet committed: the
            # batch's snapshot still counts them, and it waits on their row locks.
            removed = await taker.take(
                "WITH gone AS (DELETE FROM knowledge_chunk"
                " WHERE (version_number, embedding_model, chunk_id) IN"
                " (SELECT version_number, embedding_model, chunk_id FROM knowledge_chunk"
                "   WHERE tenant_id = 'acme' AND document_id = $1"
                "   ORDER BY version_number, embedding_model, chunk_id LIMIT $2)"
                " RETURNING 1) SELECT count(*) AS removed FROM gone",
                uuid.UUID(document_id),
                taken,
            )
            assert removed is not None
            assert removed["removed"] == taken

        publisher._erasure = PgErasureStore(pool, between_batches=between)
        await publisher.erase_document(
            "acme", uuid.UUID(document_id), ErasureRequest(requested_by="cli")
        )
        await taker.committed()
    assert await content_rows(conn, document_id) == GONE
    assert await conn.fetchval("SELECT erased_at IS NOT NULL FROM document_erasure")


async def test_kb_documents_erase(
    api: SearchHarness,
    acme: ApiTenant,
    pool: asyncpg.Pool[Any],
    service_env: dict[str, str],
    conn: asyncpg.Connection[Any],
) -> None:
    document_id, _ = await indexed(api, acme, pool, marked_text())
    result = kb(service_env, "documents", "erase", "acme", document_id)
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    assert answer["documentId"] == document_id
    assert answer["erasedAt"]
    assert answer["searchToken"]
    assert await content_rows(conn, document_id) == GONE
    audit = await conn.fetchrow("SELECT key_id, requested_by FROM document_erasure")
    assert audit is not None
    assert (audit["key_id"], audit["requested_by"]) == (None, "cli")
    again = kb(service_env, "documents", "erase", "acme", document_id)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["erasedAt"] == answer["erasedAt"]


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["acme", "not-a-uuid"], "DOCUMENT_ID_INVALID"),
        (["Acme Corp", str(uuid.uuid4())], "TENANT_NAME_INVALID"),
        (["acme", str(uuid.uuid4())], "DOCUMENT_NOT_FOUND"),
        (["acme"], "Missing argument"),
    ],
)
async def test_kb_documents_erase_exits_2_on_bad_input(
    acme: ApiTenant,
    service_env: dict[str, str],
    conn: asyncpg.Connection[Any],
    args: list[str],
    said: str,
) -> None:
    result = kb(service_env, "documents", "erase", *args)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert said in result.stderr
    assert result.stdout == ""
    assert await conn.fetchval("SELECT count(*) FROM document_erasure") == 0


async def test_erase_implies_delete_in_the_audit_rows_transaction(
    api: SearchHarness, acme: ApiTenant, pool: asyncpg.Pool[Any], conn: asyncpg.Connection[Any]
) -> None:
    document_id, revision = await indexed(api, acme, pool, marked_text())
    response = await erase(api, acme, document_id)
    assert response.status_code == 200, response.text
    row = await conn.fetchrow(
        "SELECT d.deleted_at, d.revision, e.requested_at FROM document d"
        " JOIN document_erasure e USING (tenant_id, document_id) WHERE d.document_id = $1",
        uuid.UUID(document_id),
    )
    assert row is not None
    assert row["deleted_at"] == row["requested_at"]  # one transaction, one now()
    assert row["revision"] == revision + 1
    assert await found(api, acme) == set()
    assert (
        await conn.fetchval(
            "SELECT count(*) FROM outbox WHERE event_type = 'DocumentDeleted'"
            " AND aggregate_key = $1",
            f"acme/{document_id}",
        )
        == 1
    )


async def test_a_versions_content_may_only_be_emptied_by_an_erase(
    api: SearchHarness, acme: ApiTenant, conn: asyncpg.Connection[Any]
) -> None:
    """Migration 0031 keeps 0003's immutability but for one change: emptying the content of
    a document that has an erasure row. Any other change, or emptying it without the row,
    is refused, whoever runs it."""
    document_id, _ = await published(api, acme)
    doc = uuid.UUID(document_id)
    empty = "UPDATE document_version SET content = ''::bytea WHERE document_id = $1"
    with pytest.raises(asyncpg.IntegrityConstraintViolationError):
        await conn.execute(empty, doc)
    await conn.execute(
        "INSERT INTO document_erasure (tenant_id, document_id, requested_by, requested_at)"
        " VALUES ('acme', $1, 'cli', now())",
        doc,
    )
    with pytest.raises(asyncpg.IntegrityConstraintViolationError):
        await conn.execute(
            "UPDATE document_version SET content = 'other'::bytea WHERE document_id = $1", doc
        )
    await conn.execute(empty, doc)
    assert (
        await conn.fetchval("SELECT content FROM document_version WHERE document_id = $1", doc)
        == b""
    )


async def test_a_batch_held_open_blocks_no_publish_or_search_of_another_document(
    api: SearchHarness, acme: ApiTenant, pool: asyncpg.Pool[Any], conn: asyncpg.Connection[Any]
) -> None:
    """The worst a batch can do is hold its rows until it commits. With a chunk batch and a
    content batch of the erased document held open (uncommitted, in another connection),
    another document is searched, uploaded and published at once: nothing they touch is
    locked by the batch. (An erase's document is deleted before its batches run.)"""
    document_id, _ = await indexed(api, acme, pool, marked_text(40), max_tokens=16)
    other_id, _ = await published(api, acme)
    async with running_pipeline(pool) as indexer:
        assert (await worker(pool, indexer).run_once()).name == "SUCCEEDED"
    doc = uuid.UUID(document_id)
    # The batches are fenced by the delete: they remove nothing of a live document. Marked
    # deleted by hand, as a delete through the API removes the chunks itself.
    await conn.execute("UPDATE document SET deleted_at = now() WHERE document_id = $1", doc)
    await conn.execute(
        "INSERT INTO document_erasure (tenant_id, document_id, requested_by, requested_at)"
        " VALUES ('acme', $1, 'cli', now())",
        doc,
    )
    async with pool.acquire() as held, held.transaction():
        batch = await held.fetchrow(ERASE_QUERIES["erase_chunks"], "acme", doc, 5)
        assert batch is not None
        assert batch["removed"] == 5
        await held.execute(ERASE_QUERIES["erase_version_content"], "acme", doc, 5)
        # Blocked, they would wait for the batch's commit, which comes only after them.
        async with asyncio.timeout(30):
            assert await found(api, acme) == {other_id}
            response = await upload(api.client, acme, b"Shipping takes five days.")
            assert response.status_code == 201, response.text
            new_id = response.json()["documentId"]
            response = await publish(api.client, acme, new_id, 1, 1, read=["group:all"])
            assert response.status_code == 202, response.text
