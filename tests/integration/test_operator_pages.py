"""The operator page over a real database: sign-in (operator keys only), CSRF, the
overview's numbers against the database, documents, dead tasks and the audited requeue."""

from __future__ import annotations

import re
import uuid
from typing import Any

import asyncpg
import pytest

from services.embedding.hashing import HashingEmbedder
from services.operator.auth import digest, new_operator_key
from services.operator.store_pg import PgOperatorStore
from services.runtime.tenancy.tenant_auth import new_api_key
from tests.support.operator import (
    hidden,
    operator_client,
    operator_settings,
    sign_in,
    tier_counts,
)
from tests.support.search import ChunkSpec, add_document, add_version, point_search_at
from tests.support.tasks import create_task, ensure_tenant

pytestmark = pytest.mark.integration


def cell(html: str, tier: str, metric: str) -> str:
    row = re.search(rf'<tr data-tier="{tier}">(.*?)</tr>', html, re.S)
    assert row is not None, f"no row for tier {tier}"
    value = re.search(rf'data-metric="{metric}"[^>]*>(?:<a [^>]*>)?([^<]*)<', row.group(1))
    assert value is not None, f"no {metric} in tier {tier}"
    return value.group(1).strip()


async def make_dead(
    pool: asyncpg.Pool[Any],
    tenant_id: str = "acme",
    tier: str = "standard",
    code: str = "DOCUMENT_PARSE_FAILED",
) -> uuid.UUID:
    task = await create_task(pool, tenant_id=tenant_id, tier=tier)
    await pool.execute(
        """UPDATE index_task SET status = 'DEAD', attempts = 1, error_code = $2,
                  error_message = 'pdf: startxref not found', finished_at = now()
            WHERE task_id = $1""",
        task.task_id,
        code,
    )
    return task.task_id


async def test_pages_need_an_operator_session(pool: asyncpg.Pool[Any], database_url: str) -> None:
    async with operator_client(pool, operator_settings(database_url)) as client:
        first = await client.get("/ui")
        assert first.status_code == 303
        assert first.headers["location"] == "/ui/login"
        # A tenant API key, as a bearer header or typed into the form, opens nothing.
        tenant_key = new_api_key("acme")
        bearer = await client.get("/ui", headers={"Authorization": f"Bearer {tenant_key}"})
        assert bearer.status_code == 303
        refused = await sign_in(client, tenant_key)
        assert refused.status_code == 303
        assert refused.headers["location"] == "/ui/login?error=1"
        assert (await client.get("/ui")).status_code == 303
        # A POST without a session is refused outright.
        assert (await client.post("/ui/dead/requeue", data={"csrf": "x"})).status_code == 403
        # The sign-in form's own token is checked too.
        forged = await client.post("/ui/login", data={"token": "x", "login_token": "forged"})
        assert forged.status_code == 403


async def test_operator_keys_from_the_cli_and_the_environment_sign_in(
    pool: asyncpg.Pool[Any], database_url: str
) -> None:
    key = new_operator_key()
    await PgOperatorStore(pool).create_operator_key("alice", digest(key))
    async with operator_client(pool, operator_settings(database_url)) as client:
        signed = await sign_in(client, key)
        assert signed.status_code == 303
        assert signed.headers["location"] == "/ui"
        page = await client.get("/ui")
        assert page.status_code == 200
        assert "alice" in page.text
        assert "default-src 'none'" in page.headers["content-security-policy"]
        await client.post("/ui/logout", data={"csrf": hidden(page.text, "csrf")})
        assert (await client.get("/ui")).status_code == 303
    async with operator_client(pool, operator_settings(database_url)) as client:
        assert (await sign_in(client)).headers["location"] == "/ui"
        assert ">env<" in (await client.get("/ui")).text


async def test_overview_numbers_are_the_databases(
    pool: asyncpg.Pool[Any], database_url: str
) -> None:
    await create_task(pool)  # due
    await create_task(pool)  # due
    running = await create_task(pool)
    await pool.execute(
        """UPDATE index_task SET status = 'RUNNING', attempts = 1, lease_owner = 'w1',
                  lease_until = now() - interval '1 second' WHERE task_id = $1""",
        running.task_id,
    )
    await make_dead(pool)
    await create_task(pool, tenant_id="beta", tier="premium")
    async with operator_client(pool, operator_settings(database_url)) as client:
        await sign_in(client)
        html = (await client.get("/ui")).text
    expected = await tier_counts(pool, "standard")
    assert cell(html, "standard", "due") == str(expected["due"]) == "2"
    assert cell(html, "standard", "running") == str(expected["running"]) == "1"
    assert cell(html, "standard", "leases_expired") == "1"
    assert cell(html, "standard", "dead") == str(expected["dead"]) == "1"
    assert cell(html, "premium", "due") == "1"
    assert 'id="lagging">5<' in html  # five published documents, none searchable
    assert "<svg" in html


async def test_dead_task_requeue_is_audited_and_needs_the_csrf_token(
    pool: asyncpg.Pool[Any], database_url: str
) -> None:
    first = await make_dead(pool)
    second = await make_dead(pool, tenant_id="beta", code="DOCUMENT_EMPTY")
    still_running = await create_task(pool)
    async with operator_client(pool, operator_settings(database_url)) as client:
        await sign_in(client)
        page = await client.get("/ui/dead", params={"tenant": "acme"})
        assert str(first) in page.text
        assert str(second) not in page.text  # filtered out
        csrf = hidden(page.text, "csrf")
        forged = await client.post(
            "/ui/dead/requeue", data={"csrf": "not-the-token", "task_id": str(first)}
        )
        assert forged.status_code == 403
        assert (
            await pool.fetchval("SELECT status FROM index_task WHERE task_id = $1", first) == "DEAD"
        )
        done = await client.post(
            "/ui/dead/requeue",
            data={
                "csrf": csrf,
                "task_id": [str(first), str(still_running.task_id)],
                "back": "tenant=acme",
            },
        )
        assert done.status_code == 303
        assert done.headers["location"] == "/ui/dead?tenant=acme&done=1&failed=1"
        after = await client.get(done.headers["location"])
    row = await pool.fetchrow("SELECT status, error_code FROM index_task WHERE task_id = $1", first)
    assert row is not None
    assert row["status"] == "PENDING"
    assert row["error_code"] is None
    audit = await pool.fetchrow(
        "SELECT requeued_by, previous_error_code FROM index_task_requeue WHERE task_id = $1",
        first,
    )
    assert audit is not None
    assert audit["requeued_by"] == "operator:env"
    assert audit["previous_error_code"] == "DOCUMENT_PARSE_FAILED"
    assert "Requeued 1 task" in after.text
    assert f"<strong>operator:env</strong> requeued task <code>{first}</code>" in after.text


async def test_document_page_shows_versions_tasks_and_paginates(
    pool: asyncpg.Pool[Any], database_url: str
) -> None:
    task = await create_task(pool)
    async with operator_client(pool, operator_settings(database_url, operator_page_size=2)) as c:
        await sign_in(c)
        listing = await c.get(f"/ui/tenants/{task.tenant_id}/documents")
        assert "INDEXING" in listing.text
        page = await c.get(f"/ui/tenants/{task.tenant_id}/documents/{task.document_id}")
        assert page.status_code == 200
        assert str(task.task_id) in page.text
        assert 'id="search-version">nothing yet<' in page.text
        missing = await c.get(f"/ui/tenants/{task.tenant_id}/documents/{uuid.uuid4()}")
        assert missing.status_code == 404
        for _ in range(3):
            await create_task(pool)
        first = await c.get(f"/ui/tenants/{task.tenant_id}/documents")
        assert "1\u20132 of 4" in first.text
        assert "offset=2" in first.text
        bad = await c.get(f"/ui/tenants/{task.tenant_id}/documents", params={"offset": -1})
        assert bad.status_code == 422


async def test_document_chunks_are_the_served_generations_only(
    pool: asyncpg.Pool[Any], conn: asyncpg.Connection[Any], database_url: str
) -> None:
    # One version indexed under two chunking strategies (a generation built beside the served
    # one): the page lists and counts the chunks of the strategy the pointer names, as search
    # reads them, not the other generation's.
    embedder = HashingEmbedder(dimension=64)
    await ensure_tenant(conn, "acme", "standard")
    document_id = await add_document(conn, "acme")
    served = await add_version(
        conn, "acme", document_id, 1, [ChunkSpec(f"served {i}") for i in range(3)], embedder
    )
    await conn.executemany(
        "INSERT INTO knowledge_chunk (tenant_id, document_id, version_number,"
        " embedding_model, chunk_id, ordinal, heading_path, text, content_digest,"
        " embedding_dimension, embedding, chunking_strategy)"
        " SELECT tenant_id, document_id, version_number, embedding_model,"
        " chunk_id || $2, ordinal, heading_path, 'other ' || text, content_digest,"
        " embedding_dimension, embedding, 'another-strategy'"
        " FROM knowledge_chunk WHERE chunk_id = $1",
        [(chunk, suffix) for chunk in served[:2] for suffix in ("-a", "-b")],
    )
    await point_search_at(conn, "acme", document_id, 1, embedder.model)
    found = await PgOperatorStore(pool).document("acme", document_id, chunk_offset=0, limit=10)
    assert found is not None
    assert found["chunks"].total == 3
    assert [row["chunk_id"] for row in found["chunks"].rows] == served
    async with operator_client(pool, operator_settings(database_url)) as client:
        await sign_in(client)
        page = await client.get(f"/ui/tenants/acme/documents/{document_id}")
    assert page.status_code == 200
    assert "served 0" in page.text
    assert "other served" not in page.text


@pytest.mark.parametrize("path", ["/ui/static/ui.css", "/ui/static/refresh.js"])
async def test_static_assets(pool: asyncpg.Pool[Any], database_url: str, path: str) -> None:
    async with operator_client(pool, operator_settings(database_url)) as client:
        response = await client.get(path)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith(("text/css", "text/javascript"))
    assert len(response.content) > 100


async def test_tenants_page_shows_each_tenants_recent_ingest_commands_delay_and_backlog(
    pool: asyncpg.Pool[Any], database_url: str
) -> None:
    await ensure_tenant(pool, "acme", "standard")
    await ensure_tenant(pool, "beta", "standard")
    # Two commands of acme's applied in the window, one 7.5 s after it reached Kafka; one
    # older than the window, whose delay does not count.
    await pool.executemany(
        """INSERT INTO ingest_command (tenant_id, command_id, command_type, sent_at, applied_at)
           VALUES ('acme', $1, 'PublishDocument', now() - $2::text::interval,
                   now() - $3::text::interval)""",
        [
            (uuid.uuid4(), "62.5 seconds", "55 seconds"),
            (uuid.uuid4(), "2 seconds", "1 second"),
            (uuid.uuid4(), "2 hours", "1 hour"),
        ],
    )
    # Acme's backlog as two `kb ingest run` processes report it, and as a third, stopped an
    # hour ago, last did (not counted).
    await pool.executemany(
        """INSERT INTO ingest_backlog
               (tier, consumer_id, tenant_id, records, oldest_sent_at, reported_at)
           VALUES ('standard', $1, 'acme', $2, now() - $3::text::interval,
                   now() - $4::text::interval)""",
        [
            (uuid.uuid4(), 30, "4 seconds", "1 second"),
            (uuid.uuid4(), 12, "9.5 seconds", "2 seconds"),
            (uuid.uuid4(), 500, "2 hours", "59 minutes"),
        ],
    )
    async with operator_client(pool, operator_settings(database_url)) as client:
        await sign_in(client)
        page = (await client.get("/ui/tenants")).text

    def tenant_cell(tenant: str, metric: str) -> str:
        row = re.search(rf'<tr data-tenant="{tenant}">(.*?)</tr>', page, re.S)
        assert row is not None
        value = re.search(rf'data-metric="{metric}">([^<]*)<', row.group(1))
        assert value is not None
        return value.group(1)

    assert tenant_cell("acme", "ingest-commands") == "2"
    assert tenant_cell("acme", "ingest-delay") == "7.5 s"
    assert tenant_cell("beta", "ingest-commands") == "0"
    assert tenant_cell("beta", "ingest-delay") == "\u2014"
    backlog = re.fullmatch(r"42 \(oldest ([0-9.]+) s\)", tenant_cell("acme", "ingest-backlog"))
    assert backlog is not None
    # The oldest is the 9.5 s one, as old now as the page's read makes it; not the stale one.
    assert 9.5 <= float(backlog.group(1)) < 3600
    assert tenant_cell("beta", "ingest-backlog") == "0"
