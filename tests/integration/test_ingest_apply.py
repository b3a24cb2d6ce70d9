"""Ingest commands applied on the real database: each kind, in the publish's own transaction,
recorded once by command id (docs/architecture.md#publish-by-event)."""

from __future__ import annotations

import uuid
from typing import Any

import asyncpg
import pytest

from services.indexer.queue.store_pg import PgTaskQueue
from services.indexer.queue.worker import RunOnceResult, Worker
from services.indexer.retry import RetryPolicy
from services.publisher.domain import Publisher, RevisionConflict, Upload
from services.publisher.ingest.apply import DocumentKeyUnknown, IngestApplier
from services.publisher.ingest.commands import CommandInvalid, decode_command
from services.publisher.ingest.runs import Arrived, RunApplier
from services.publisher.ingest.store_pg import DocumentKeyTaken, PgIngestStore
from services.publisher.ports import ErasureRequest
from services.runtime.erasure.erase_pg import PgErasureStore
from services.runtime.errors import Conflict, KbError
from services.runtime.messaging.avro import default_registry
from tests.support.api import add_tenant
from tests.support.ingest import (
    delete_command,
    erase_command,
    publish_command,
    readers_command,
)
from tests.support.pipeline import running_pipeline

pytestmark = pytest.mark.integration


@pytest.fixture
async def parts(pool: asyncpg.Pool[Any]) -> tuple[IngestApplier, Publisher]:
    store = PgIngestStore(pool)
    publisher = Publisher(store, max_upload_bytes=1 << 20, erasure=PgErasureStore(pool))
    return IngestApplier(publisher, store, max_upload_bytes=1 << 20), publisher


@pytest.fixture
async def tenant(conn: asyncpg.Connection[Any]) -> str:
    return (await add_tenant(conn, "acme")).tenant_id


async def _apply(applier: IngestApplier, payload: bytes) -> Any:
    return await applier.apply(decode_command(payload, max_inline_bytes=1 << 20))


async def _events(conn: asyncpg.Connection[Any], event_type: str) -> list[dict[str, Any]]:
    rows = await conn.fetch(
        "SELECT payload FROM outbox WHERE event_type = $1 ORDER BY position", event_type
    )
    return [default_registry().decode(bytes(r["payload"])).record for r in rows]


async def _index(pool: asyncpg.Pool[Any], *, tasks: int) -> None:
    """Runs the indexer's worker until ``tasks`` tasks succeeded, one after the other."""
    async with running_pipeline(pool) as indexer:
        work = Worker(
            PgTaskQueue(pool), indexer, tier="standard", owner="it-ingest", policy=RetryPolicy()
        )
        for _ in range(tasks):
            assert await work.run_once() is RunOnceResult.SUCCEEDED


async def _counts(conn: asyncpg.Connection[Any]) -> tuple[int, ...]:
    row = await conn.fetchrow(
        """SELECT (SELECT count(*) FROM document_version), (SELECT count(*) FROM outbox),
                  (SELECT count(*) FROM index_task), (SELECT count(*) FROM ingest_command),
                  (SELECT count(*) FROM document_version_acl)"""
    )
    assert row is not None
    return tuple(row)


async def test_a_publish_creates_the_document_maps_its_key_and_names_the_command(
    parts: tuple[IngestApplier, Publisher], tenant: str, conn: asyncpg.Connection[Any]
) -> None:
    applier, _ = parts
    command_id = uuid.uuid4()
    answer = await _apply(applier, publish_command(tenant, "page-1", command_id=command_id))
    assert answer.changed
    assert (answer.version_number, answer.revision) == (1, 2)
    assert answer.task_id is not None
    mapped = await conn.fetchval(
        "SELECT document_id FROM ingest_document_key WHERE tenant_id = $1 AND document_key = $2",
        tenant,
        "page-1",
    )
    assert mapped == answer.document_id
    published = await _events(conn, "DocumentVersionPublished")
    assert [e["commandId"] for e in published] == [command_id]
    assert published[0]["indexTaskId"] == answer.task_id

    second = await _apply(applier, publish_command(tenant, "page-1", b"hello again"))
    assert second.document_id == answer.document_id
    assert second.version_number == 2


async def test_a_redelivered_command_changes_nothing_and_answers_the_same(
    parts: tuple[IngestApplier, Publisher], tenant: str, conn: asyncpg.Connection[Any]
) -> None:
    applier, _ = parts
    payload = publish_command(tenant, "page-1")
    first = await _apply(applier, payload)
    before = await _counts(conn)
    again = await _apply(applier, payload)
    assert not again.changed
    assert (again.document_id, again.version_number, again.revision, again.task_id) == (
        first.document_id,
        first.version_number,
        first.revision,
        first.task_id,
    )
    assert await _counts(conn) == before


async def test_a_publish_by_reference_publishes_an_api_upload(
    parts: tuple[IngestApplier, Publisher], tenant: str, conn: asyncpg.Connection[Any]
) -> None:
    applier, publisher = parts
    created = await publisher.create_document(
        tenant, "Big", Upload(b"large content", "text/plain", "big.txt")
    )
    answer = await _apply(
        applier,
        publish_command(tenant, "big", None, upload=(created.document_id, 1), read=["u:ann"]),
    )
    assert (answer.document_id, answer.version_number) == (created.document_id, 1)
    # The key is the document's now: a reference to another document is refused.
    other = await publisher.create_document(tenant, "Other", Upload(b"x", "text/plain", "o.txt"))
    with pytest.raises(CommandInvalid):
        await _apply(applier, publish_command(tenant, "big", None, upload=(other.document_id, 1)))
    # And a document has one key.
    with pytest.raises(DocumentKeyTaken):
        await _apply(
            applier, publish_command(tenant, "big-2", None, upload=(created.document_id, 1))
        )


async def test_set_readers_republishes_the_published_version_with_its_acl(
    parts: tuple[IngestApplier, Publisher], tenant: str, conn: asyncpg.Connection[Any]
) -> None:
    applier, _ = parts
    first = await _apply(applier, publish_command(tenant, "page-1", read=["group:a"]))
    command_id = uuid.uuid4()
    answer = await _apply(
        applier, readers_command(tenant, "page-1", ["group:b", "u:ann"], command_id=command_id)
    )
    assert (answer.version_number, answer.revision) == (1, first.revision + 1)
    acl = await conn.fetchval(
        "SELECT array_agg(principal ORDER BY principal) FROM document_version_acl "
        "WHERE tenant_id = $1 AND document_id = $2",
        tenant,
        first.document_id,
    )
    assert acl == ["group:b", "u:ann"]
    published = await _events(conn, "DocumentVersionPublished")
    assert published[-1]["commandId"] == command_id
    assert published[-1]["readPrincipals"] == ["group:b", "u:ann"]


async def test_delete_has_the_http_revision_rules_and_names_the_command(
    parts: tuple[IngestApplier, Publisher], tenant: str, conn: asyncpg.Connection[Any]
) -> None:
    applier, _ = parts
    first = await _apply(applier, publish_command(tenant, "page-1"))
    with pytest.raises(RevisionConflict):
        await _apply(
            applier, delete_command(tenant, "page-1", expected_revision=first.revision - 1)
        )
    command_id = uuid.uuid4()
    deleted = await _apply(applier, delete_command(tenant, "page-1", command_id=command_id))
    assert deleted.revision == first.revision + 1
    assert [e["commandId"] for e in await _events(conn, "DocumentDeleted")] == [command_id]
    # Another delete command of a deleted document answers what the delete did, whatever
    # the revision it names (HTTP DELETE's rule), and writes no event.
    later = await _apply(applier, delete_command(tenant, "page-1", expected_revision=1))
    assert later.revision == deleted.revision
    assert len(await _events(conn, "DocumentDeleted")) == 1


async def test_erase_erases_and_is_recorded_once(
    parts: tuple[IngestApplier, Publisher], tenant: str, conn: asyncpg.Connection[Any]
) -> None:
    applier, _ = parts
    first = await _apply(applier, publish_command(tenant, "page-1", b"secret words"))
    payload = erase_command(tenant, "page-1")
    erased = await _apply(applier, payload)
    assert erased.document_id == first.document_id
    row = await conn.fetchrow(
        "SELECT requested_by, erased_at FROM document_erasure WHERE document_id = $1",
        first.document_id,
    )
    assert row is not None
    assert row["requested_by"] == "ingest"
    assert row["erased_at"] is not None
    content = await conn.fetchval(
        "SELECT content FROM document_version WHERE document_id = $1", first.document_id
    )
    assert content == b""
    again = await _apply(applier, payload)
    assert not again.changed
    assert await conn.fetchval("SELECT count(*) FROM ingest_command") == 2


async def _keys(conn: asyncpg.Connection[Any]) -> list[str]:
    return [r["document_key"] for r in await conn.fetch("SELECT * FROM ingest_document_key")]


async def test_an_erase_forgets_the_producer_key_and_a_redelivery_resurrects_nothing(
    parts: tuple[IngestApplier, Publisher], tenant: str, conn: asyncpg.Connection[Any]
) -> None:
    """The producer's key may be personal data (a user's address as a page id): the erase
    removes its row, yet every copy of the commands before it stays a repeat."""
    applier, _ = parts
    publish = publish_command(tenant, "jane@example.com", b"secret words")
    first = await _apply(applier, publish)
    erase = erase_command(tenant, "jane@example.com")
    erased = await _apply(applier, erase)
    assert await _keys(conn) == []
    before = await _counts(conn)
    again = await _apply(applier, erase)
    assert (again.changed, again.document_id) == (False, erased.document_id)
    repeated = await _apply(applier, publish)
    assert (repeated.changed, repeated.document_id) == (False, first.document_id)
    assert await _counts(conn) == before
    assert await conn.fetchval("SELECT count(*) FROM document") == 1
    assert await conn.fetchval("SELECT max(length(content)) FROM document_version") == 0
    with pytest.raises(DocumentKeyUnknown):  # a new erase of the key: nothing is known
        await _apply(applier, erase_command(tenant, "jane@example.com"))


async def test_an_erase_recorded_after_a_crash_still_answers_and_forgets_the_key(
    parts: tuple[IngestApplier, Publisher], tenant: str, conn: asyncpg.Connection[Any]
) -> None:
    """A crash after the erase's batches and before the command's record: the key is still
    mapped (it goes with the record), so the redelivered command finds its document."""
    applier, publisher = parts
    first = await _apply(applier, publish_command(tenant, "page-1", b"secret words"))
    command_id = uuid.uuid4()
    await publisher.erase_document(
        tenant, first.document_id, ErasureRequest(requested_by="ingest"), command_id=command_id
    )
    assert await _keys(conn) == ["page-1"]
    answer = await _apply(applier, erase_command(tenant, "page-1", command_id=command_id))
    assert (answer.changed, answer.document_id) == (True, first.document_id)
    assert await _keys(conn) == []


async def test_an_erase_over_http_forgets_the_producer_key_too(
    parts: tuple[IngestApplier, Publisher], tenant: str, conn: asyncpg.Connection[Any]
) -> None:
    applier, publisher = parts
    first = await _apply(applier, publish_command(tenant, "page-1", b"secret words"))
    await publisher.erase_document(tenant, first.document_id, ErasureRequest(requested_by="api"))
    assert await _keys(conn) == []
    # A later publish of the key is a new document, as after a delete.
    later = await _apply(applier, publish_command(tenant, "page-1", b"new words"))
    assert later.document_id != first.document_id


async def test_a_refused_command_leaves_nothing_not_even_its_id(
    parts: tuple[IngestApplier, Publisher], tenant: str, conn: asyncpg.Connection[Any]
) -> None:
    applier, _ = parts
    with pytest.raises(DocumentKeyUnknown):
        await _apply(applier, readers_command(tenant, "never-published", ["u:ann"]))
    assert await _counts(conn) == (0, 0, 0, 0, 0)


async def test_the_switch_event_names_the_command_that_published_the_version(
    parts: tuple[IngestApplier, Publisher],
    tenant: str,
    conn: asyncpg.Connection[Any],
    pool: asyncpg.Pool[Any],
) -> None:
    applier, publisher = parts
    command_id = uuid.uuid4()
    answer = await _apply(
        applier, publish_command(tenant, "page-1", b"words to index", command_id=command_id)
    )
    # Readers set afterwards name the same task: the switch still names the publish.
    await _apply(applier, readers_command(tenant, "page-1", ["u:ann"]))
    # A version published over HTTP names no command.
    created = await publisher.create_document(tenant, "Plain", Upload(b"plain", "text/plain", "p"))
    await publisher.publish(
        tenant, created.document_id, 1, expected_revision=1, read_principals=["u:ann"]
    )
    await _index(pool, tasks=2)
    switched = {
        e["documentId"]: e["commandId"]
        for e in await _events(conn, "DocumentSearchVersionSwitched")
    }
    assert switched == {answer.document_id: command_id, created.document_id: None}


async def test_a_key_published_after_its_delete_gets_a_new_document(
    parts: tuple[IngestApplier, Publisher], tenant: str, conn: asyncpg.Connection[Any]
) -> None:
    applier, _ = parts
    first = await _apply(applier, publish_command(tenant, "page-1", b"before"))
    await _apply(applier, delete_command(tenant, "page-1"))
    # Readers of a deleted document are refused, as over HTTP.
    with pytest.raises(Conflict):
        await _apply(applier, readers_command(tenant, "page-1", ["u:ann"]))
    again = await _apply(applier, publish_command(tenant, "page-1", b"after"))
    assert again.document_id != first.document_id
    assert again.version_number == 1
    mapped = await conn.fetchval(
        "SELECT document_id FROM ingest_document_key WHERE document_key = 'page-1'"
    )
    assert mapped == again.document_id


async def test_a_run_writes_new_documents_together_and_refuses_a_poison_alone_once(
    parts: tuple[IngestApplier, Publisher],
    pool: asyncpg.Pool[Any],
    conn: asyncpg.Connection[Any],
    tenant: str,
) -> None:
    applier, _ = parts
    runs = RunApplier(applier, PgIngestStore(pool))
    payloads = [
        publish_command(tenant, "a", b"a one"),
        publish_command(tenant, "b", b"b one"),
        # Inline, new, and refused (a blank principal) when the run writes it.
        publish_command(tenant, "poison", b"x", read=[" "]),
        publish_command(tenant, "c", b"c one"),
        publish_command(tenant, "a", b"a two"),  # after a's first: its version 2
    ]
    items = [
        Arrived(decode_command(p, max_inline_bytes=1 << 20), f"t/0/{n}")
        for n, p in enumerate(payloads)
    ]
    refused: list[tuple[int, str]] = []

    async def refuse(n: int, error: KbError) -> None:
        refused.append((n, error.code))

    answers = await runs.apply_run(items, refuse)
    assert [a is not None and a.changed for a in answers] == [True, True, False, True, True]
    assert refused == [(2, "PRINCIPAL_INVALID")]
    versions = await conn.fetch(
        "SELECT k.document_key, v.version_number, convert_from(v.content, 'UTF8') AS text, "
        "v.status FROM ingest_document_key k JOIN document_version v USING "
        "(tenant_id, document_id) ORDER BY k.document_key, v.version_number"
    )
    assert [(r["document_key"], r["version_number"], r["text"]) for r in versions] == [
        ("a", 1, "a one"),
        ("a", 2, "a two"),
        ("b", 1, "b one"),
        ("c", 1, "c one"),
    ]
    published = await _events(conn, "DocumentVersionPublished")
    assert sorted(e["commandId"] for e in published) == sorted(
        i.command.command_id for n, i in enumerate(items) if n != 2
    )
    tasks = await conn.fetchval("SELECT count(*) FROM index_task WHERE status = 'PENDING'")
    assert tasks == 4

    # Redelivered: every one answers as before, nothing written, the poison not refused
    # again but answered with the code it was refused with.
    before = await _counts(conn)
    told: list[tuple[int, str]] = []
    again = await runs.apply_run(
        items, refuse, refused_before=lambda n, code: told.append((n, code))
    )
    assert [a is not None and not a.changed for a in again] == [True, True, False, True, True]
    assert refused == [(2, "PRINCIPAL_INVALID")]
    assert told == [(2, "PRINCIPAL_INVALID")]
    assert await _counts(conn) == before


async def test_a_redelivered_delete_removes_the_chunks_a_crash_left(
    parts: tuple[IngestApplier, Publisher],
    tenant: str,
    conn: asyncpg.Connection[Any],
    pool: asyncpg.Pool[Any],
) -> None:
    """A crash between a delete's commit and its chunks' removal leaves them; the command's
    redelivery (answered by its earlier answer) removes them."""
    applier, _ = parts
    published = await _apply(applier, publish_command(tenant, "page-1", b"words to index"))
    await _index(pool, tasks=1)
    chunks = "SELECT count(*) FROM knowledge_chunk WHERE document_id = $1"
    assert await conn.fetchval(chunks, published.document_id) > 0
    await conn.execute(
        "CREATE TABLE kept_chunks AS SELECT * FROM knowledge_chunk WHERE document_id = $1",
        published.document_id,
    )
    delete = delete_command(tenant, "page-1")
    deleted = await _apply(applier, delete)
    assert await conn.fetchval(chunks, published.document_id) == 0
    # What the crash left: the chunks back, as if their removal never ran (without the
    # triggers that stop the code from writing a deleted document's rows).
    columns = ", ".join(
        await conn.fetchval(
            "SELECT array_agg(column_name::text ORDER BY ordinal_position)"
            "  FROM information_schema.columns"
            " WHERE table_name = 'knowledge_chunk' AND is_generated = 'NEVER'"
            "   AND table_schema = current_schema()"
        )
    )
    async with conn.transaction():
        await conn.execute("SET LOCAL session_replication_role = replica")
        await conn.execute(
            f"INSERT INTO knowledge_chunk ({columns}) SELECT {columns} FROM kept_chunks"
        )
    assert await conn.fetchval(chunks, published.document_id) > 0
    redelivered = await _apply(applier, delete)
    assert (redelivered.revision, redelivered.changed) == (deleted.revision, False)
    assert await conn.fetchval(chunks, published.document_id) == 0
