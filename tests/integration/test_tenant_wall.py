"""The second wall between tenants (migrations/0029,
services/runtime/tenancy/tenant_wall.py): inside the API's tenant transactions, PostgreSQL
itself returns and accepts only the tenant's rows, even for a statement that forgot its
tenant filter; and no pooled connection keeps the role or the tenant after its
transaction."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from services.embedding.hashing import HashingEmbedder
from services.publisher.domain import Publisher, Upload
from services.publisher.store_pg import PgPublisherStore
from services.runtime.pg.db import create_pool_without_session_reset
from services.runtime.settings import RuntimeSettings
from services.runtime.tenancy.tenant_wall import (
    TENANT_ROLE,
    tenant_transaction,
    walls_search,
    walls_the_publisher,
)
from services.search.index_pg import PgSearchIndex
from services.search.searcher import Generation, Searcher, SearchMode, SearchRequest
from services.search.statements import SearchSettings
from tests.support.api import add_tenant
from tests.support.search import ChunkSpec, add_document, add_version, point_search_at

pytestmark = pytest.mark.integration

EMBEDDER = HashingEmbedder(64)
ACME, GLOBEX = "acme", "globex"
# Every tenant-scoped table the API's role may read, each read without a tenant filter.
READABLE = (
    "tenant",
    "document",
    "document_version",
    "document_version_acl",
    "document_acl",
    "document_search_version",
    "knowledge_chunk",
    "index_task",
    "outbox",
)
SESSION_STATE = "SELECT current_user AS role, current_setting('kb.tenant_id', true) AS tenant"


@pytest.fixture
async def wall_pool(settings: RuntimeSettings) -> AsyncIterator[asyncpg.Pool[Any]]:
    """Two connections (hybrid search reads its second list on the second), never reset
    on release, as the API's pools: what one use of a connection leaves behind, the next
    one sees."""
    pool = await create_pool_without_session_reset(settings, min_size=2, max_size=2)
    try:
        yield pool
    finally:
        await pool.close()


@pytest.fixture
async def two_tenants(conn: asyncpg.Connection[Any], wall_pool: asyncpg.Pool[Any]) -> None:
    """Two tenants with a row in every table above: a published document each (through the
    publisher, behind the wall) and a searchable one (written as the sink leaves it)."""
    publisher = Publisher(PgPublisherStore(wall_pool), max_upload_bytes=1 << 20)
    for tenant_id in (ACME, GLOBEX):
        await add_tenant(conn, tenant_id)
        created = await publisher.create_document(
            tenant_id, "Refunds", Upload(b"# Refunds\n\n30 days.", "text/markdown", "r.md")
        )
        await publisher.publish(
            tenant_id,
            created.document_id,
            1,
            expected_revision=created.revision,
            read_principals=["group:all"],
        )
        searchable = await add_document(conn, tenant_id, title=f"{tenant_id} refunds")
        await add_version(
            conn, tenant_id, searchable, 1, [ChunkSpec(f"{tenant_id} refunds in 30 days")], EMBEDDER
        )
        await point_search_at(conn, tenant_id, searchable, 1, EMBEDDER.model)


async def _tenants_of(conn: asyncpg.Connection[Any], table: str) -> set[str]:
    return {r["tenant_id"] for r in await conn.fetch(f"SELECT tenant_id FROM {table}")}


@pytest.mark.usefixtures("two_tenants")
async def test_unfiltered_reads_see_only_the_walled_tenant(
    conn: asyncpg.Connection[Any],
) -> None:
    for table in READABLE:  # the owner, unwalled, sees both: the reads below can fail
        assert await _tenants_of(conn, table) == {ACME, GLOBEX}, table
    async with tenant_transaction(conn, ACME, row_security=True):
        assert await conn.fetchval("SELECT current_user") == TENANT_ROLE
        for table in READABLE:
            assert await _tenants_of(conn, table) == {ACME}, table
    # Without a tenant (never set in the session, then set and ended: ''), nothing at all.
    for _ in range(2):
        async with conn.transaction():
            await conn.execute(f"SET LOCAL ROLE {TENANT_ROLE}")
            for table in READABLE:
                assert await _tenants_of(conn, table) == set(), table


@pytest.mark.usefixtures("two_tenants")
async def test_writes_for_another_tenant_are_refused(conn: asyncpg.Connection[Any]) -> None:
    acme_documents = await conn.fetchval("SELECT count(*) FROM document WHERE tenant_id = $1", ACME)
    async with tenant_transaction(conn, ACME, row_security=True):
        # Another tenant's rows are not there to change.
        changed = await conn.execute("UPDATE document SET title = 'mine' WHERE true")
        assert changed == f"UPDATE {acme_documents}"
        await conn.execute("DELETE FROM document_acl WHERE true")
    assert set(await conn.fetchval("SELECT array_agg(tenant_id) FROM document_acl")) == {GLOBEX}
    retitled = await conn.fetch("SELECT DISTINCT tenant_id FROM document WHERE title = 'mine'")
    assert [r["tenant_id"] for r in retitled] == [ACME]
    for statement in (
        "INSERT INTO document (tenant_id, document_id, title)"
        f" VALUES ('{GLOBEX}', gen_random_uuid(), 'planted')",
        f"UPDATE document SET tenant_id = '{GLOBEX}' WHERE true",
    ):
        with pytest.raises(asyncpg.InsufficientPrivilegeError, match="row-level security"):
            async with tenant_transaction(conn, ACME, row_security=True):
                await conn.execute(statement)
    # A partition is not a way around its parent's policy: the role may not read it.
    with pytest.raises(asyncpg.InsufficientPrivilegeError):
        async with tenant_transaction(conn, ACME, row_security=True):
            await conn.fetch("SELECT * FROM knowledge_chunk_p00")


@pytest.mark.usefixtures("two_tenants")
async def test_pooled_connections_keep_neither_role_nor_tenant(
    settings: RuntimeSettings, wall_pool: asyncpg.Pool[Any]
) -> None:
    async def session_state() -> list[tuple[str, str]]:
        """Each connection's role and tenant (the setting, once set in a session, reads ''
        after its transaction; NULL before), both connections taken at once."""
        async with wall_pool.acquire() as first, wall_pool.acquire() as second:
            rows: list[Any] = [await c.fetchrow(SESSION_STATE) for c in (first, second)]
        return [(r["role"], r["tenant"] or "") for r in rows]

    owner = await conn_role(wall_pool)
    assert owner != TENANT_ROLE
    clean = [(owner, "")] * 2
    store = PgPublisherStore(wall_pool)
    # The publisher's transaction, committed and failed, and its reads.
    async with store.transaction(ACME) as tx:
        assert await tx.lock_document(GLOBEX, await _a_document_of(wall_pool, GLOBEX)) is None
    assert await session_state() == clean
    with pytest.raises(RuntimeError):
        async with store.transaction(ACME):
            raise RuntimeError
    assert await session_state() == clean
    assert await store.document_status(ACME, await _a_document_of(wall_pool, GLOBEX)) is None
    assert await session_state() == clean
    # A search of each mode: only the tenant's own chunk, and the connection clean after.
    index = PgSearchIndex(
        wall_pool,
        Generation(EMBEDDER.model, EMBEDDER.dimension),
        SearchSettings(database_url=settings.database_url),
    )
    searcher = Searcher(EMBEDDER, index)
    for mode in (SearchMode.HYBRID, SearchMode.VECTOR, SearchMode.KEYWORD):
        result = await searcher.search(
            SearchRequest(
                tenant_id=ACME, query="refunds 30 days", principals=("group:all",), mode=mode
            )
        )
        await index.ended()
        assert [r.title for r in result.results] == [f"{ACME} refunds"], mode
        assert await session_state() == clean


async def conn_role(pool: asyncpg.Pool[Any]) -> str:
    async with pool.acquire() as pooled:
        role: str = await pooled.fetchval("SELECT current_user")
    return role


async def _a_document_of(pool: asyncpg.Pool[Any], tenant_id: str) -> Any:
    async with pool.acquire() as pooled:
        return await pooled.fetchval(
            "SELECT document_id FROM document WHERE tenant_id = $1 LIMIT 1", tenant_id
        )


async def test_without_the_wall_the_transaction_runs_as_the_connecting_role(
    conn: asyncpg.Connection[Any],
) -> None:
    owner = await conn.fetchval("SELECT current_user")
    async with tenant_transaction(conn, ACME, row_security=False):
        state: Any = await conn.fetchrow(SESSION_STATE)
        assert dict(state) == {"role": owner, "tenant": None}


async def test_auto_walls_search_where_the_full_text_match_is_leakproof(
    conn: asyncpg.Connection[Any],
) -> None:
    assert walls_the_publisher("auto")
    assert walls_the_publisher("on")
    assert not walls_the_publisher("off")
    # The migration marks the match LEAKPROOF when a superuser runs it (the test servers').
    superuser = await conn.fetchval("SELECT rolsuper FROM pg_roles WHERE rolname = current_user")
    assert await walls_search(conn, "auto") is superuser
    assert await walls_search(conn, "on") is True
    assert await walls_search(conn, "off") is False
    if superuser:

        class Undone(Exception):
            pass

        with pytest.raises(Undone):
            async with conn.transaction():
                await conn.execute(
                    "ALTER FUNCTION pg_catalog.ts_match_vq(tsvector, tsquery) NOT LEAKPROOF"
                )
                assert await walls_search(conn, "auto") is False
                raise Undone
