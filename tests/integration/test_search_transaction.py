"""A search's transaction (real PostgreSQL): it starts with a kept path's settings in one
round trip, ends after the answer -- committed, or rolled back when the search failed --
and its connections go back to the pool either way (the pool ``kb serve`` opens:
open_search_pool, which does not reset released sessions)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from services.embedding.hashing import HashingEmbedder
from services.runtime.errors import KbError
from services.runtime.pg.db import _init_connection, connection
from services.runtime.settings import RuntimeSettings
from services.runtime.tenancy.tenant_wall import TENANT_ROLE, walls_search
from services.search.connections import open_search_pool
from services.search.index_pg import PgSearchIndex
from services.search.searcher import Generation, SearchMode, SearchRequest
from services.search.statements import SearchSettings
from tests.support.api import add_tenant
from tests.support.locks import wait_until_blocked_on_a_lock
from tests.support.search import ChunkSpec, add_document, add_version, point_search_at

pytestmark = pytest.mark.integration

EMBEDDER = HashingEmbedder(64)
MODES = (SearchMode.HYBRID, SearchMode.VECTOR, SearchMode.KEYWORD)


class Statements:
    """What the pool's connections send, as asyncpg logs it."""

    def __init__(self) -> None:
        self.sent: list[str] = []

    def log(self, record: Any) -> None:
        self.sent.append(record.query)

    async def init(self, conn: asyncpg.Connection[Any]) -> None:
        await _init_connection(conn)
        conn.add_query_logger(self.log)


@pytest.fixture
async def statements() -> Statements:
    return Statements()


@pytest.fixture
async def pool(settings: RuntimeSettings, statements: Statements) -> AsyncIterator[Any]:
    pool = await open_search_pool(settings, min_size=2, max_size=4, init=statements.init)
    try:
        yield pool
    finally:
        await pool.close()


@pytest.fixture
async def index(pool: asyncpg.Pool[Any], settings: RuntimeSettings) -> PgSearchIndex:
    return PgSearchIndex(
        pool,
        Generation(EMBEDDER.model, EMBEDDER.dimension),
        SearchSettings(database_url=settings.database_url),
    )


@pytest.fixture
async def corpus(conn: asyncpg.Connection[Any]) -> None:
    await add_tenant(conn, "acme", "standard")
    for n in range(3):
        document_id = await add_document(conn, "acme", title=f"Doc {n}", read=("group:all",))
        chunks = [ChunkSpec(f"clause {c} of policy {n} on refunds") for c in range(4)]
        await add_version(conn, "acme", document_id, 1, chunks, EMBEDDER)
        await point_search_at(conn, "acme", document_id, 1, EMBEDDER.model)


@pytest.fixture
async def reported() -> AsyncIterator[list[dict[str, Any]]]:
    """What reaches the event loop's exception handler (asyncpg reports there a connection
    released in an open transaction)."""
    loop = asyncio.get_running_loop()
    previous = loop.get_exception_handler()
    seen: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _, context: seen.append(context))
    yield seen
    loop.set_exception_handler(previous)


def request(mode: SearchMode) -> SearchRequest:
    return SearchRequest("acme", "refunds policy", ("group:all",), 10, mode)


VECTOR = EMBEDDER.embed_sync(["refunds policy"])[0]


async def all_back(pool: asyncpg.Pool[Any]) -> bool:
    return pool.get_idle_size() == pool.get_size()


async def answered_once(index: PgSearchIndex, statements: Statements, mode: SearchMode) -> Any:
    """A search's answer, its path now kept and its transaction ended; nothing logged yet."""
    answer = await index.candidates(request(mode), VECTOR)
    await index.ended()
    statements.sent.clear()
    return answer


@pytest.mark.parametrize("mode", MODES, ids=lambda m: str(m.value))
async def test_a_search_ends_its_transaction_after_the_answer(
    pool: asyncpg.Pool[Any],
    index: PgSearchIndex,
    statements: Statements,
    corpus: None,
    reported: list[dict[str, Any]],
    mode: SearchMode,
) -> None:
    first = await index.candidates(request(mode), VECTOR)
    await index.ended()
    assert await all_back(pool)
    statements.sent.clear()
    again = await index.candidates(request(mode), VECTOR)
    await index.ended()
    assert again == first
    assert len(first.vector if mode.uses_vector else first.keyword) >= 10
    assert await all_back(pool)
    begins = [s for s in statements.sent if s.startswith("BEGIN")]
    assert statements.sent.count("COMMIT") == len(begins) >= 1
    assert "ROLLBACK" not in statements.sent
    # The tenant wall, where search is behind it, rides on every BEGIN (hybrid's second
    # connection's too): no round trip of its own.
    walled = await walls_search(pool, "auto")
    assert all((f"SET LOCAL ROLE {TENANT_ROLE};" in begin) is walled for begin in begins)
    if mode.uses_vector:
        # The kept path's settings ride on BEGIN: no round trip of their own.
        assert "SET LOCAL hnsw.ef_search" in begins[0]
        assert not [s for s in statements.sent if s.startswith("SET LOCAL")]
    assert reported == []


@pytest.mark.parametrize("mode", MODES, ids=lambda m: str(m.value))
async def test_a_failed_search_rolls_back_and_returns_its_connections(
    pool: asyncpg.Pool[Any],
    index: PgSearchIndex,
    statements: Statements,
    conn: asyncpg.Connection[Any],
    corpus: None,
    reported: list[dict[str, Any]],
    mode: SearchMode,
) -> None:
    before = await answered_once(index, statements, mode)
    await conn.execute("ALTER TABLE document_acl RENAME TO document_acl_gone")
    with pytest.raises(KbError):
        await index.candidates(request(mode), VECTOR)
    await index.ended()
    assert await all_back(pool)
    assert "ROLLBACK" in statements.sent
    assert "COMMIT" not in statements.sent
    assert reported == []
    await conn.execute("ALTER TABLE document_acl_gone RENAME TO document_acl")
    assert await index.candidates(request(mode), VECTOR) == before


@pytest.mark.parametrize("mode", MODES, ids=lambda m: str(m.value))
async def test_a_cancelled_search_rolls_back_and_returns_its_connections(
    settings: RuntimeSettings,
    pool: asyncpg.Pool[Any],
    index: PgSearchIndex,
    statements: Statements,
    conn: asyncpg.Connection[Any],
    corpus: None,
    reported: list[dict[str, Any]],
    mode: SearchMode,
) -> None:
    # A client gone while the search's statements run (hybrid: on both connections).
    before = await answered_once(index, statements, mode)
    waiting = 2 if mode is SearchMode.HYBRID else 1
    async with connection(settings) as watcher, conn.transaction():
        await conn.execute("LOCK TABLE document_acl IN ACCESS EXCLUSIVE MODE")
        search = asyncio.create_task(index.candidates(request(mode), VECTOR))
        await wait_until_blocked_on_a_lock(watcher, waiting)
        search.cancel()
        with pytest.raises(asyncio.CancelledError):
            await search
    await index.ended()
    assert await all_back(pool)
    assert statements.sent.count("ROLLBACK") == waiting
    assert "COMMIT" not in statements.sent
    assert reported == []
    assert await index.candidates(request(mode), VECTOR) == before


# What a search sets, and what a session has when nothing set it.
SESSION_DEFAULTS = {
    "enable_hashjoin": "on",
    "enable_mergejoin": "on",
    "enable_sort": "on",
    "enable_bitmapscan": "on",
    "enable_material": "on",
    "max_parallel_workers_per_gather": "2",
    "plan_cache_mode": "auto",
    "hnsw.ef_search": "40",
    "hnsw.iterative_scan": "off",
}


async def session_settings(conn: Any) -> dict[str, str]:
    await conn.fetchval("SELECT '[1]'::vector")  # pgvector's settings exist once it is loaded
    rows = await conn.fetch(
        "SELECT name, current_setting(name) AS value FROM unnest($1::text[]) AS n(name)",
        list(SESSION_DEFAULTS),
    )
    return {row["name"]: row["value"] for row in rows}


@pytest.mark.parametrize("mode", MODES, ids=lambda m: str(m.value))
async def test_released_connections_are_not_reset_and_keep_nothing_of_the_search(
    pool: asyncpg.Pool[Any],
    index: PgSearchIndex,
    statements: Statements,
    corpus: None,
    mode: SearchMode,
) -> None:
    # Principals reading a corner of the tenant take the exact path, the rest the ANN path:
    # both paths' settings must end with the transaction, without RESET ALL on release.
    await answered_once(index, statements, mode)
    narrow = SearchRequest("acme", "refunds policy", ("group:nobody",), 10, mode)
    await index.candidates(narrow, VECTOR)
    await index.candidates(request(mode), VECTOR)
    await index.ended()
    assert await all_back(pool)
    assert not [s for s in statements.sent if "RESET ALL" in s or "UNLISTEN" in s]
    held = [await pool.acquire() for _ in range(pool.get_size())]
    try:
        for conn in held:
            assert await session_settings(conn) == SESSION_DEFAULTS
            # (asyncpg's type introspection turns jit off and back with a session-level
            # set_config: the source says session, the value is the default.)
            changed = await conn.fetchval(
                "SELECT array_agg(name) FROM pg_settings"
                " WHERE source = 'session' AND setting IS DISTINCT FROM reset_val"
            )
            assert changed is None
    finally:
        for conn in held:
            await pool.release(conn)
