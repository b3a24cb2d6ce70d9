"""`kb index check [--repair]` for deleted and erased documents
(docs/architecture.md#document-lifecycle), on real PostgreSQL: after a real delete and a
real erase, each leftover is planted by SQL the way a restore from an older backup or a
hand-edited row would leave it; the check names it by kind and count (ids only, never
content), `--repair` removes exactly that, finishes an erase left half-done, leaves a live
document untouched, and is idempotent."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from services.publisher.domain import Publisher
from services.publisher.store_pg import PgPublisherStore
from services.runtime.erasure.erase_pg import QUERIES as ERASE_QUERIES
from services.runtime.erasure.erase_pg import PgErasureStore
from services.runtime.errors import DatabaseUnavailable
from services.runtime.messaging.outbox import aggregate_key
from services.runtime.settings import RuntimeSettings
from tests.integration.test_document_delete import delete, found, published, worker
from tests.integration.test_document_erase import MARKER, erase, indexed, marked_text, pg_dump
from tests.support.api import ApiTenant, add_tenant
from tests.support.cli import kb
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


async def index_pending(pool: asyncpg.Pool[Any]) -> None:
    async with running_pipeline(pool) as indexer:
        while (await worker(pool, indexer).run_once()).name != "IDLE":
            pass


async def rows_of(conn: asyncpg.Connection[Any], document_id: uuid.UUID) -> dict[str, Any]:
    """Every row of a document the check's repair could touch, with the transaction that
    last wrote it (xmin): equal before and after means not one row was written."""
    queries = {
        "document": "SELECT xmin::text, * FROM document WHERE document_id = $1",
        "pointer": "SELECT xmin::text, * FROM document_search_version WHERE document_id = $1",
        "chunks": "SELECT xmin::text, chunk_id FROM knowledge_chunk WHERE document_id = $1",
        "acl": "SELECT xmin::text, * FROM document_acl WHERE document_id = $1",
        "versions": "SELECT xmin::text, * FROM document_version WHERE document_id = $1",
        "version_acl": "SELECT xmin::text, * FROM document_version_acl WHERE document_id = $1",
        "tasks": "SELECT xmin::text, * FROM index_task WHERE document_id = $1",
    }
    return {
        name: sorted(tuple(row) for row in await conn.fetch(query, document_id))
        for name, query in queries.items()
    }


async def plant(conn: asyncpg.Connection[Any], *statements: tuple[str, list[Any]]) -> None:
    """Statements run as a restore would run them: without the triggers (migration 0030's
    walls around a tombstone, 0003's immutable versions), which only stop the code."""
    async with conn.transaction():
        await conn.execute("SET LOCAL session_replication_role = replica")
        for statement, args in statements:
            await conn.execute(statement, *args)


async def chunk_columns(conn: asyncpg.Connection[Any]) -> str:
    """knowledge_chunk's columns but the generated ones (an INSERT may not name them)."""
    columns: list[str] = await conn.fetchval(
        "SELECT array_agg(column_name::text ORDER BY ordinal_position)"
        "  FROM information_schema.columns"
        " WHERE table_name = 'knowledge_chunk' AND is_generated = 'NEVER'"
        "   AND table_schema = current_schema()"
    )
    return ", ".join(columns)


def copied_chunks(
    columns: str, source: uuid.UUID, target: uuid.UUID, text: str | None = None
) -> list[tuple[str, list[Any]]]:
    """Statements that give ``target`` a copy of ``source``'s chunks (its text replaced by
    ``text`` if given), as a restore of rows removed since would."""
    return [
        (
            "CREATE TEMP TABLE planted ON COMMIT DROP AS"
            " SELECT * FROM knowledge_chunk WHERE document_id = $1",
            [source],
        ),
        (
            "UPDATE planted SET document_id = $1, text = coalesce($2, text)",
            [target, text],
        ),
        (f"INSERT INTO knowledge_chunk ({columns}) SELECT {columns} FROM planted", []),
        ("DROP TABLE planted", []),
    ]


def kinds(stdout: str) -> list[tuple[str, str]]:
    return sorted((line.split()[0], line.split()[2]) for line in stdout.splitlines())


async def test_check_reports_a_deleted_documents_leftovers_and_repair_removes_only_them(
    api: SearchHarness,
    acme: ApiTenant,
    pool: asyncpg.Pool[Any],
    conn: asyncpg.Connection[Any],
    service_env: dict[str, str],
) -> None:
    live_id, _ = await published(api, acme)
    gone_id, gone_revision = await published(api, acme)
    restored_id, restored_revision = await published(api, acme)
    await index_pending(pool)
    live, gone, restored = (uuid.UUID(d) for d in (live_id, gone_id, restored_id))
    for document_id, revision in ((gone_id, gone_revision), (restored_id, restored_revision)):
        assert (await delete(api, acme, document_id, revision)).status_code == 200
    assert await found(api, acme) == {live_id}

    # A delete leaves nothing for the check: its transaction tombstones the pointer and
    # drops the served ACL and staged slices, and its chunks go in batches right after.
    after_delete = kb(service_env, "index", "check")
    assert after_delete.returncode == 0, after_delete.stdout + after_delete.stderr
    assert (
        await conn.fetchval(
            "SELECT count(*) FROM knowledge_chunk WHERE document_id = ANY ($1::uuid[])",
            [gone, restored],
        )
        == 0
    )

    # A restore from a backup older than the deletes: `gone` lost its tombstone and got its
    # chunks, a served ACL row and a staged slice back; `restored` is served again.
    gone_task = await conn.fetchval("SELECT task_id FROM index_task WHERE document_id = $1", gone)
    await plant(
        conn,
        *copied_chunks(await chunk_columns(conn), live, gone),
        ("DELETE FROM document_search_version WHERE document_id = $1", [gone]),
        ("INSERT INTO document_acl VALUES ('acme', $1, 'group:all', 'READ')", [gone]),
        (
            "INSERT INTO knowledge_chunk_stream (task_id, lease_attempt, chunk_id, ordinal,"
            " heading_path, text, content_digest, embedding)"
            " SELECT $1, 1, chunk_id, ordinal, heading_path, text, content_digest, embedding"
            "   FROM knowledge_chunk WHERE document_id = $2 ORDER BY ordinal LIMIT 1",
            [gone_task, gone],
        ),
        *copied_chunks(await chunk_columns(conn), live, restored),
        (
            "UPDATE document_search_version s SET deleted_at = NULL,"
            " chunking_strategy = k.chunking_strategy, chunk_count = k.n"
            " FROM (SELECT chunking_strategy, count(*)::int AS n FROM knowledge_chunk"
            "        WHERE document_id = $1 GROUP BY 1) k WHERE s.document_id = $1",
            [restored],
        ),
        ("INSERT INTO document_acl VALUES ('acme', $1, 'group:all', 'READ')", [restored]),
    )
    assert await found(api, acme) == {live_id, restored_id}  # the drift is real
    live_before = await rows_of(conn, live)

    checked = kb(service_env, "index", "check")
    assert checked.returncode == 1, checked.stdout + checked.stderr
    assert kinds(checked.stdout) == sorted(
        [
            ("DELETED_NOT_TOMBSTONED", gone_id),
            ("DELETED_CHUNKS", gone_id),
            ("DELETED_STAGED_SLICES", gone_id),
            ("DELETED_ACL", gone_id),
            ("DELETED_NOT_TOMBSTONED", restored_id),
            ("DELETED_CHUNKS", restored_id),
            ("DELETED_ACL", restored_id),
        ]
    )
    # Counts and ids, never content; a deleted document is never queued again (without its
    # tombstone, the live documents' check would have re-run its SUCCEEDED task).
    assert "deleted, 1 staged slices left" in checked.stdout
    assert "deleted, 1 served ACL rows left" in checked.stdout
    assert "thirty days" not in checked.stdout + checked.stderr
    assert "3 documents, 7 drifted, 0 repaired" in checked.stderr

    repaired = kb(service_env, "index", "check", "--repair")
    assert repaired.returncode == 0, repaired.stdout + repaired.stderr
    verdicts = [line.split("  ->  ")[1].split()[0] for line in repaired.stdout.splitlines()]
    assert verdicts == ["REPAIRED"] * 7, repaired.stdout
    assert "7 drifted, 7 repaired, 0 left" in repaired.stderr

    assert await found(api, acme) == {live_id}
    for doc in (gone, restored):
        pointer = await conn.fetchrow(
            "SELECT deleted_at, chunking_strategy FROM document_search_version"
            " WHERE document_id = $1",
            doc,
        )
        assert pointer is not None
        assert pointer["deleted_at"] is not None
        assert pointer["chunking_strategy"] is None
        for table in ("knowledge_chunk", "document_acl"):
            left = f"SELECT count(*) FROM {table} WHERE document_id = $1"
            assert await conn.fetchval(left, doc) == 0
    assert await conn.fetchval("SELECT count(*) FROM knowledge_chunk_stream") == 0
    # No task was queued: a deleted document is never indexed again.
    assert await conn.fetchval("SELECT count(*) FROM index_task WHERE status <> 'SUCCEEDED'") == 0
    # A deleted (not erased) document keeps its versions: removing them is the erase's job.
    assert await conn.fetchval(
        "SELECT count(*) FROM document_version WHERE document_id = $1 AND content <> ''", gone
    )
    assert await rows_of(conn, live) == live_before

    again = kb(service_env, "index", "check", "--repair")
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout == ""
    assert "3 documents, 0 drifted" in again.stderr
    assert await rows_of(conn, live) == live_before


async def test_check_finds_what_an_erase_should_have_removed_and_repair_finishes_it(
    api: SearchHarness,
    acme: ApiTenant,
    pool: asyncpg.Pool[Any],
    conn: asyncpg.Connection[Any],
    service_env: dict[str, str],
    database_url: str,
) -> None:
    live_id, _ = await published(api, acme)
    await index_pending(pool)
    erased_id, _ = await indexed(api, acme, pool, marked_text(3))
    live, erased = uuid.UUID(live_id), uuid.UUID(erased_id)
    published_event = await conn.fetchrow(
        "SELECT position, payload FROM outbox WHERE event_type = 'DocumentVersionPublished'"
        " AND aggregate_key = $1",
        aggregate_key("acme", erased),
    )
    assert published_event is not None
    response = await erase(api, acme, erased_id)
    assert response.status_code == 200, response.text
    clean = kb(service_env, "index", "check")
    assert clean.returncode == 0, clean.stdout + clean.stderr  # a whole erase leaves nothing

    # A restore of content rows the erase removed, and its audit row put back in progress.
    task = await conn.fetchval("SELECT task_id FROM index_task WHERE document_id = $1", erased)
    await plant(
        conn,
        *copied_chunks(await chunk_columns(conn), live, erased, MARKER),
        (
            "UPDATE document_version SET content = $2 WHERE document_id = $1",
            [erased, MARKER.encode()],
        ),
        ("INSERT INTO document_version_acl VALUES ('acme', $1, 1, $2, 'READ')", [erased, MARKER]),
        ("UPDATE index_task SET error_message = $2 WHERE task_id = $1", [task, MARKER]),
        (
            "INSERT INTO index_task_requeue (task_id, requeued_by, requeued_at, reset_attempts,"
            " attempts, previous_max_attempts, new_max_attempts, previous_error_message)"
            " VALUES ($1, 'it', now(), false, 1, 8, 8, $2)",
            [task, MARKER],
        ),
        ("UPDATE document SET title = $2 WHERE document_id = $1", [erased, MARKER]),
        (
            "UPDATE outbox SET payload = $2 WHERE position = $1",
            [published_event["position"], published_event["payload"]],
        ),
        ("UPDATE document_erasure SET erased_at = NULL WHERE document_id = $1", [erased]),
    )
    assert MARKER.encode() in pg_dump(database_url)
    live_before = await rows_of(conn, live)

    checked = kb(service_env, "index", "check")
    assert checked.returncode == 1, checked.stdout + checked.stderr
    assert kinds(checked.stdout) == sorted(
        [("DELETED_CHUNKS", erased_id), ("ERASE_UNFINISHED", erased_id)]
    )
    assert (
        "erase asked for, erased_at unset; left: version bytes 1, version ACL rows 1, "
        "task error texts 1, requeue error texts 1, outbox events with content 1, title 1"
    ) in checked.stdout
    assert "deleted, 1 chunk rows left" in checked.stdout
    assert MARKER not in checked.stdout + checked.stderr

    repaired = kb(service_env, "index", "check", "--repair")
    assert repaired.returncode == 0, repaired.stdout + repaired.stderr
    assert "2 drifted, 2 repaired, 0 left" in repaired.stderr
    # Finished, not papered over: every byte gone, then erased_at set again.
    assert MARKER.encode() not in pg_dump(database_url)
    assert await conn.fetchval(
        "SELECT erased_at IS NOT NULL FROM document_erasure WHERE document_id = $1", erased
    )
    assert await rows_of(conn, live) == live_before
    assert await found(api, acme) == {live_id}
    again = kb(service_env, "index", "check", "--repair")
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout == ""


async def test_no_removal_statement_touches_a_live_document(
    api: SearchHarness, acme: ApiTenant, pool: asyncpg.Pool[Any], conn: asyncpg.Connection[Any]
) -> None:
    """The fence: every statement the repair and the erase remove by reads the document's
    deleted_at itself, so whoever runs one on a live document (a wrong id, a race with a
    script) changes nothing, even with an erasure row planted beside it."""
    live_id, _ = await published(api, acme)
    await index_pending(pool)
    live = uuid.UUID(live_id)
    await conn.execute(
        "INSERT INTO document_erasure (tenant_id, document_id, requested_by, requested_at)"
        " VALUES ('acme', $1, 'cli', now())",
        live,
    )
    before = await rows_of(conn, live)
    store = PgErasureStore(pool)
    removed = await store.remove_deleted_leftovers("acme", live, batch_rows=100)
    assert set(removed.values()) == {0}
    for query in ERASE_QUERIES:
        if query.startswith("erase_"):
            batch = await pool.fetchrow(ERASE_QUERIES[query], "acme", live, 100)
            assert batch is not None
            assert (batch["removed"], batch["seen"]) == (0, 0), query
    assert await rows_of(conn, live) == before
    assert await found(api, acme) == {live_id}


async def test_kb_documents_delete_removes_the_chunks_and_leaves_the_check_clean(
    api: SearchHarness,
    acme: ApiTenant,
    pool: asyncpg.Pool[Any],
    conn: asyncpg.Connection[Any],
    service_env: dict[str, str],
) -> None:
    """The operator's delete removes the chunks after its commit, as the API's does."""
    document_id, revision = await published(api, acme)
    await index_pending(pool)
    chunks = "SELECT count(*) FROM knowledge_chunk WHERE document_id = $1"
    assert await conn.fetchval(chunks, uuid.UUID(document_id)) > 0
    deleted = kb(
        service_env, "documents", "delete", "acme", document_id, "--revision", str(revision)
    )
    assert deleted.returncode == 0, deleted.stderr
    assert await conn.fetchval(chunks, uuid.UUID(document_id)) == 0
    checked = kb(service_env, "index", "check")
    assert checked.returncode == 0, checked.stdout + checked.stderr


class UnreachableLeftovers(PgErasureStore):
    """The erase store of a delete whose connection is lost right after its commit."""

    async def remove_deleted_leftovers(
        self, tenant_id: str, document_id: uuid.UUID, *, batch_rows: int, now: Any = None
    ) -> dict[str, int]:
        raise DatabaseUnavailable("the connection was lost")


async def test_a_delete_whose_chunk_removal_fails_is_done_and_leaves_them_to_repair(
    api: SearchHarness,
    acme: ApiTenant,
    pool: asyncpg.Pool[Any],
    conn: asyncpg.Connection[Any],
    service_env: dict[str, str],
) -> None:
    """The delete committed: its answer says so (no 5xx for a done delete), the document is
    out of search, and the chunks it could not remove are the check's DELETED_CHUNKS, which
    --repair removes."""
    document_id, revision = await published(api, acme)
    await index_pending(pool)
    publisher = Publisher(
        PgPublisherStore(pool), max_upload_bytes=1024, erasure=UnreachableLeftovers(pool)
    )
    deleted = await publisher.delete_document(
        "acme", uuid.UUID(document_id), expected_revision=revision
    )
    assert deleted.changed
    assert await found(api, acme) == set()
    checked = kb(service_env, "index", "check")
    assert checked.returncode == 1, checked.stdout + checked.stderr
    assert kinds(checked.stdout) == [("DELETED_CHUNKS", document_id)]
    repaired = kb(service_env, "index", "check", "--repair")
    assert repaired.returncode == 0, repaired.stdout + repaired.stderr
    chunks = "SELECT count(*) FROM knowledge_chunk WHERE document_id = $1"
    assert await conn.fetchval(chunks, uuid.UUID(document_id)) == 0
