"""Search slots, far tokens and replicas (security review, issue 41): a search holds one of
the process's slots only while it reads -- never while it waits for a replica to replay its
`after` token, nor while its answer is written -- a token the primary has not written is
refused, a wait for a slot is bounded, the replicas' lag check never trusts a replica it
cannot judge, and a status read on a replica carries a token at or past what it can see."""

from __future__ import annotations

import asyncio
import json
import select
import socket
import time
from collections.abc import Sequence
from typing import Any

import asyncpg
import httpx
import pytest
from starlette.types import Message

from services.app import create_app
from services.embedding.hashing import HashingEmbedder
from services.embedding.port import Vectors
from services.embedding.settings import EmbeddingSettings, HashingConfig
from services.publisher.settings import PublisherSettings
from services.publisher.store_pg import PgPublisherStore
from services.publisher.web.api import PublisherStores
from services.runtime.fair_share.settings import FairShareSettings
from services.search.connections import open_search_pool
from services.search.index_pg import PgSearchIndex
from services.search.replicas import format_token, parse_token
from services.search.searcher import Generation, Searcher
from services.search.statements import SearchSettings
from tests.support.api import BASE_URL, UNTHROTTLED, ApiTenant, add_tenant, live_app
from tests.support.clock import SecondsClock
from tests.support.replica import caught_up, one_replica_rotation
from tests.support.search import (
    ChunkSpec,
    add_document,
    add_version,
    generation_search_app,
    point_search_at,
)

pytestmark = pytest.mark.integration

QUERY = {"query": "refund clause", "principals": ["group:all"], "mode": "keyword"}
# A guard against a hang, never a measure: everything below finishes in well under a second
# when it works.
HANG = 60.0


# --- servers --------------------------------------------------------------------------------


# How far past the primary's insert position a token is "ahead" without being the largest
# one: no test cluster writes a TiB of WAL while a test runs (the clusters are persistent, so
# a fixed position such as 1/0 would one day be behind).
AHEAD_BY = 1 << 40


async def _ahead(conn: asyncpg.Connection[Any]) -> str:
    written = parse_token(await conn.fetchval("SELECT pg_current_wal_insert_lsn()::text"))
    return format_token(min(written + AHEAD_BY, (1 << 64) - 1))


def _client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE_URL)


async def _searchable_tenant(conn: asyncpg.Connection[Any], embedder: HashingEmbedder) -> ApiTenant:
    tenant = await add_tenant(conn)
    document_id = await add_document(conn, tenant.tenant_id)
    await add_version(
        conn, tenant.tenant_id, document_id, 1, [ChunkSpec("refund clause one")], embedder
    )
    await point_search_at(conn, tenant.tenant_id, document_id, 1, embedder.model)
    return tenant


# --- a token ahead of the primary ----------------------------------------------------------


async def test_a_far_token_is_refused_and_never_holds_up_another_tenants_search(
    replica_urls: tuple[str, str], replica_pools: tuple[Any, Any]
) -> None:
    """One slot; an attacker loops searches with a token the primary never wrote. Before the
    fix each of them waited the whole after-wait inside the slot, and the other tenant's
    searches queued behind them (about the after-wait each)."""
    primary_url, replica_url = replica_urls
    primary_pool, replica_pool = replica_pools
    embedder = HashingEmbedder(64)
    after_wait = 5.0
    rotation = one_replica_rotation(primary_pool, replica_pool, after_wait_seconds=after_wait)
    await rotation.check()
    settings = SearchSettings(database_url=primary_url)
    app, search = generation_search_app(
        primary_pool,
        settings,
        embedder,
        rotation=rotation,
        auth_settings=UNTHROTTLED,
        fair_share_settings=FairShareSettings(search_global_concurrency=1),
    )
    primary = await asyncpg.connect(primary_url)
    try:
        attacker = await _searchable_tenant(primary, embedder)
        victim = await _searchable_tenant(primary, embedder)
        await caught_up(primary_url, replica_url)
        done, answered = asyncio.Event(), asyncio.Event()
        answers: list[httpx.Response] = []

        async with _client(app) as client:

            async def attack(token: str) -> None:
                while not done.is_set():
                    answers.append(
                        await client.post(
                            attacker.path("/search"),
                            json={**QUERY, "after": [token]},
                            headers=attacker.headers,
                        )
                    )
                    answered.set()

            attackers = [
                asyncio.create_task(attack(token))
                for token in ("FFFFFFFF/FFFFFFFF", await _ahead(primary), "FFFFFFFF/FFFFFFFF")
            ]
            try:
                await answered.wait()  # the attack is under way before the victim comes
                took: list[float] = []
                for _ in range(6):
                    started = time.monotonic()
                    response = await client.post(
                        victim.path("/search"), json=QUERY, headers=victim.headers
                    )
                    took.append(time.monotonic() - started)
                    assert response.status_code == 200, response.text
            finally:
                done.set()
                await asyncio.gather(*attackers)
        # The bound: six small searches within one after-wait, generous for a loaded
        # two-core machine; queued behind the attack every other one took the whole after-wait
        # (15 s in all).
        assert sum(took) < after_wait, took
        assert {a.status_code for a in answers} == {422}, answers[0].text
        problem = answers[0].json()
        assert problem["errorCode"] == "SEARCH_TOKEN_AHEAD"
        assert answers[0].headers["content-type"] == "application/problem+json"
        # A token the primary has just written is not ahead: answered, not refused, though
        # minted after the rotation last read the primary.
        fresh = await primary.fetchval("SELECT pg_current_wal_insert_lsn()::text")
        async with _client(app) as client:
            response = await client.post(
                victim.path("/search"), json={**QUERY, "after": [fresh]}, headers=victim.headers
            )
        assert response.status_code == 200, response.text
    finally:
        await primary.close()
        await search.aclose()


async def test_without_replicas_a_far_token_is_refused_alike(
    module_database: str, integration_only: None
) -> None:
    pool = await open_search_pool(SearchSettings(database_url=module_database))
    embedder = HashingEmbedder(64)
    settings = SearchSettings(database_url=module_database)
    app, search = generation_search_app(pool, settings, embedder, auth_settings=UNTHROTTLED)
    conn = await asyncpg.connect(module_database)
    try:
        tenant = await _searchable_tenant(conn, embedder)
        fresh = await conn.fetchval("SELECT pg_current_wal_insert_lsn()::text")
        async with _client(app) as client:
            far, now = [
                await client.post(
                    tenant.path("/search"), json={**QUERY, "after": [token]}, headers=tenant.headers
                )
                for token in ("FFFFFFFF/FFFFFFFF", fresh)
            ]
        assert far.status_code == 422, far.text
        assert far.json()["errorCode"] == "SEARCH_TOKEN_AHEAD"
        assert now.status_code == 200, now.text
    finally:
        await conn.close()
        await search.aclose()
        await pool.close()


# --- the slot and the answer -----------------------------------------------------------------


def _search_scope(tenant: ApiTenant, body: bytes) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": tenant.path("/search"),
        "raw_path": tenant.path("/search").encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [
            (b"host", b"publisher.test"),
            (b"authorization", f"Bearer {tenant.key}".encode()),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("publisher.test", 80),
        "state": {},
    }


async def test_a_client_that_never_reads_its_answer_does_not_hold_a_slot(
    module_database: str, integration_only: None
) -> None:
    """One slot. A client's connection stops reading: the server's write of the answer
    blocks (as an ASGI server's send may wait for the client: uvicorn's does for an answer
    sent in pieces once the socket's buffers are full). Another tenant's search is answered
    meanwhile."""
    pool = await open_search_pool(SearchSettings(database_url=module_database))
    embedder = HashingEmbedder(64)
    index = PgSearchIndex(
        pool, Generation(embedder.model, 64), SearchSettings(database_url=module_database)
    )
    app = create_app(
        PublisherSettings(database_url=module_database),
        stores=PublisherStores(PgPublisherStore(pool)),
        searcher=Searcher(embedder, index),
        auth_settings=UNTHROTTLED,
        fair_share_settings=FairShareSettings(search_global_concurrency=1),
    )
    conn = await asyncpg.connect(module_database)
    try:
        stalled = await _searchable_tenant(conn, embedder)
        other = await _searchable_tenant(conn, embedder)
        body = httpx.Request("POST", "/", json=QUERY).content
        writing, reads = asyncio.Event(), asyncio.Event()
        sent = False

        async def receive() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Event().wait()  # the client never closes either
            raise AssertionError("unreachable")

        async def send(message: Message) -> None:
            if message["type"] == "http.response.body":
                writing.set()
                await reads.wait()  # the client does not read

        async with _client(app) as client:
            stuck = asyncio.create_task(app(_search_scope(stalled, body), receive, send))
            async with asyncio.timeout(HANG):
                await writing.wait()
                response = await client.post(
                    other.path("/search"), json=QUERY, headers=other.headers
                )
            assert response.status_code == 200, response.text
            assert app.state.fair_share.slots.in_use == 0
            reads.set()
            await stuck
    finally:
        await conn.close()
        await pool.close()


async def test_a_raw_connection_that_never_reads_does_not_hold_a_slot(
    module_database: str, integration_only: None
) -> None:
    """The same over a real socket, the app served by uvicorn as `kb serve` serves it: one
    slot; a client sends a search whose answer is far larger than the sockets' buffers and
    never reads it. Another tenant's search is answered while the first answer is stuck.
    (uvicorn takes a one-piece answer into its own buffer without waiting for the client, so
    this held before the slot was given back early too; the test above, whose server waits
    as a server may, is the one the early release is for.)"""
    settings = PublisherSettings(database_url=module_database)
    app = create_app(
        settings,
        search_settings=SearchSettings(database_url=module_database),
        embedding_settings=EmbeddingSettings(provider=HashingConfig(kind="hashing", dimensions=64)),
        auth_settings=UNTHROTTLED,
        fair_share_settings=FairShareSettings(search_global_concurrency=1),
    )
    embedder = HashingEmbedder(64)
    conn = await asyncpg.connect(module_database)
    try:
        big = await add_tenant(conn)
        document_id = await add_document(conn, big.tenant_id)
        # About 8 MB of answer: past the kernel's buffers on both ends and uvicorn's own.
        text = "refund clause " + "the customer may return the item " * 2500
        chunks = [ChunkSpec(f"{n} {text}") for n in range(100)]
        await add_version(conn, big.tenant_id, document_id, 1, chunks, embedder)
        await point_search_at(conn, big.tenant_id, document_id, 1, embedder.model)
        other = await _searchable_tenant(conn, embedder)
    finally:
        await conn.close()
    body = json.dumps({**QUERY, "topK": 100}).encode()
    request = (
        f"POST {big.path('/search')} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Authorization: Bearer {big.key}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    with live_app(app, settings) as url:
        port = int(url.rsplit(":", 1)[1])
        stalled = socket.socket()
        try:
            stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            stalled.connect(("127.0.0.1", port))
            stalled.sendall(request)
            # The answer has started to arrive (peeked at, never read): the server is
            # writing it, and stays stuck in the write.
            readable, _, _ = await asyncio.to_thread(select.select, [stalled], [], [], HANG)
            assert readable, "the search was not answered"
            assert stalled.recv(12, socket.MSG_PEEK) == b"HTTP/1.1 200"
            async with httpx.AsyncClient(base_url=url, timeout=HANG) as client:
                response = await client.post(
                    other.path("/search"), json=QUERY, headers=other.headers
                )
            assert response.status_code == 200, response.text
        finally:
            stalled.close()


class HeldEmbedder(HashingEmbedder):
    """Embeds once ``release`` is set; ``entered`` is set when a query waits."""

    def __init__(self, dimension: int) -> None:
        super().__init__(dimension)
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    async def embed(self, texts: Sequence[str]) -> Vectors:
        self.entered.set()
        await self.release.wait()
        return await super().embed(texts)


async def test_a_search_that_waits_too_long_for_a_slot_is_answered_429(
    module_database: str, integration_only: None
) -> None:
    pool = await open_search_pool(SearchSettings(database_url=module_database))
    embedder = HeldEmbedder(64)
    index = PgSearchIndex(
        pool, Generation(embedder.model, 64), SearchSettings(database_url=module_database)
    )
    searcher = Searcher(embedder, index, query_embed_timeout_seconds=HANG)
    fair = FairShareSettings.model_validate(
        {"search_global_concurrency": 1, "search_slot_wait_seconds": 0.2}
    )
    app = create_app(
        PublisherSettings(database_url=module_database),
        stores=PublisherStores(PgPublisherStore(pool)),
        searcher=searcher,
        auth_settings=UNTHROTTLED,
        fair_share_settings=fair,
    )
    conn = await asyncpg.connect(module_database)
    try:
        holder = await _searchable_tenant(conn, embedder)
        waiter = await _searchable_tenant(conn, embedder)
        async with _client(app) as client:
            held = asyncio.create_task(
                client.post(
                    holder.path("/search"),
                    json={**QUERY, "mode": "vector"},
                    headers=holder.headers,
                )
            )
            async with asyncio.timeout(HANG):
                await embedder.entered.wait()  # its slot taken, its embedding held
                refused = await client.post(
                    waiter.path("/search"), json=QUERY, headers=waiter.headers
                )
            embedder.release.set()
            assert (await held).status_code == 200
        assert refused.status_code == 429, refused.text
        assert refused.headers["content-type"] == "application/problem+json"
        assert int(refused.headers["retry-after"]) >= 1
        assert refused.json()["errorCode"] == "SEARCH_SLOT_WAIT_TIMEOUT"
        fair_share = app.state.fair_share
        assert fair_share.slots.in_use == 0
        assert fair_share.slots.waiting() == 0
        assert fair_share.shares.tracked() == 0
    finally:
        await conn.close()
        await pool.close()


# --- the replicas' lag check -------------------------------------------------------------


async def test_a_lag_check_whose_primary_read_fails_or_hangs_trusts_no_replica(
    module_database: str, integration_only: None
) -> None:
    """The "replica" is a second pool on the primary (it answers its insert position): what
    is under test is the primary's side of the check."""
    settings = SearchSettings(database_url=module_database, db_pool_max_size=1)
    replica_pool = await open_search_pool(SearchSettings(database_url=module_database))
    try:
        for failure in ("hangs", "fails"):
            primary_pool = await open_search_pool(settings, min_size=1)
            clock = SecondsClock()
            rotation = one_replica_rotation(
                primary_pool,
                replica_pool,
                max_lag_seconds=1.0,
                after_wait_seconds=0,
                check_seconds=0.1,
                clock=clock,
            )
            held = None
            try:
                await rotation.check()
                assert [v.in_rotation for v in rotation.views()] == [True]
                if failure == "hangs":  # every connection of the primary's pool busy
                    held = await primary_pool.acquire()
                else:
                    await primary_pool.close()
                # Within the lag limit of the last good check: the replica stays.
                clock.now = 0.5
                async with asyncio.timeout(HANG):
                    await rotation.check()
                assert [v.in_rotation for v in rotation.views()] == [True], failure
                # Past it, the primary still unreadable: its lag is unknown, so it leaves.
                clock.now = 1.6
                async with asyncio.timeout(HANG):
                    await rotation.check()
                (view,) = rotation.views()
                assert not view.in_rotation, failure
                assert view.lag_seconds is None or view.lag_seconds > 1.0
            finally:
                if held is not None:
                    await primary_pool.release(held)
                await primary_pool.close()
    finally:
        await replica_pool.close()


# --- the status token on a replica ----------------------------------------------------------


async def test_a_status_read_on_a_replica_carries_a_token_past_all_it_received(
    replica_urls: tuple[str, str], replica_pools: tuple[Any, Any]
) -> None:
    """A replica makes a replayed commit visible before ``pg_last_wal_replay_lsn()`` moves
    past it: a token from the replay position alone can name a point before a commit the
    read saw. Every commit the replica can show was received first, so the token is the
    larger of the received and replayed positions. Shown with the replay paused behind WAL
    the replica has received."""
    primary_url, replica_url = replica_urls
    primary_pool, replica_pool = replica_pools
    embedder = HashingEmbedder(64)
    rotation = one_replica_rotation(primary_pool, replica_pool, after_wait_seconds=0)
    await rotation.check()
    app = create_app(
        PublisherSettings(database_url=primary_url),
        stores=PublisherStores(PgPublisherStore(primary_pool, status_replicas=rotation)),
        searcher=Searcher(embedder, _NoIndex(embedder)),
    )
    primary = await asyncpg.connect(primary_url)
    replica = await asyncpg.connect(replica_url)
    try:
        tenant = await _searchable_tenant(primary, embedder)
        document_id = await primary.fetchval(
            "SELECT document_id FROM document WHERE tenant_id = $1", tenant.tenant_id
        )
        await caught_up(primary_url, replica_url)
        await replica.execute("SELECT pg_wal_replay_pause()")
        async with asyncio.timeout(HANG):
            # Polled: a standby signals neither a receipt nor that its pause took effect.
            while True:
                await add_tenant(primary)  # WAL for the replica to receive
                written = await primary.fetchval("SELECT pg_current_wal_flush_lsn()::text")
                while True:
                    received = await replica.fetchval("SELECT pg_last_wal_receive_lsn()::text")
                    if received is not None and parse_token(received) >= parse_token(written):
                        break
                    await asyncio.sleep(0.01)
                replayed = await replica.fetchval("SELECT pg_last_wal_replay_lsn()::text")
                if parse_token(replayed) < parse_token(received):
                    break  # paused behind WAL it has received: the state under test
        async with _client(app) as client:
            response = await client.get(
                tenant.path(f"/documents/{document_id}"), headers=tenant.headers
            )
        assert response.status_code == 200, response.text
        status = response.json()
        assert status["searchVersion"] == 1
        # Received before the read: the token is at or past it (the replayed position is not).
        assert parse_token(status["searchToken"]) >= parse_token(received)
    finally:
        await primary.close()
        await replica.close()


class _NoIndex:
    """The status test searches nothing."""

    def __init__(self, embedder: HashingEmbedder) -> None:
        self.generation = Generation(embedder.model, embedder.dimension)

    async def candidates(self, request: Any, vector: Any) -> Any:
        raise AssertionError("not searched")
