"""Search on a real streaming replica (docs/scaling.md#search-on-replicas): a search naming a
pointer switch's token never answers from the version before it, whether the replica
replays or its replay is paused; a paused replica leaves the rotation and comes back. A
document's status is read there too, and on the primary when the replica lacks the
document (docs/scaling.md#status-on-replicas)."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import asyncpg
import httpx
import pytest

from services.app import create_app
from services.embedding.hashing import HashingEmbedder
from services.embedding.settings import EmbeddingSettings, HashingConfig
from services.publisher.settings import PublisherSettings
from services.publisher.store_pg import PgPublisherStore
from services.publisher.web.api import PublisherStores
from services.publisher.web.api import create_app as create_publisher_app
from services.search.connections import open_search_pool
from services.search.replicas import PRIMARY, parse_token, replica_name
from services.search.serving import GenerationSearch
from services.search.statements import SearchSettings
from tests.support.api import BASE_URL, ApiTenant, add_tenant
from tests.support.clock import SecondsClock
from tests.support.replica import REPLICA, caught_up, one_replica_rotation
from tests.support.search import (
    ChunkSpec,
    add_document,
    add_version,
    generation_search_app,
    point_search_at,
)

pytestmark = pytest.mark.integration

VERSIONS = 7
CHUNKS = 3


async def _pause(replica: asyncpg.Connection[Any], paused: bool) -> None:
    await replica.execute(
        "SELECT pg_wal_replay_pause()" if paused else "SELECT pg_wal_replay_resume()"
    )


async def test_a_switch_token_never_answers_from_the_old_version(
    replica_urls: tuple[str, str], replica_pools: tuple[Any, Any]
) -> None:
    primary_url, replica_url = replica_urls
    primary_pool, replica_pool = replica_pools
    embedder = HashingEmbedder(64)
    settings = SearchSettings(database_url=primary_url, search_exact_max_chunks=10_000_000)
    # A lag limit nobody reaches: the paused replica stays in rotation, so only the token
    # keeps a search off it.
    rotation = one_replica_rotation(primary_pool, replica_pool, after_wait_seconds=0.2)
    await rotation.check()
    assert [view.in_rotation for view in rotation.views()] == [True]
    app, search = generation_search_app(primary_pool, settings, embedder, rotation=rotation)
    primary = await asyncpg.connect(primary_url)
    replica = await asyncpg.connect(replica_url)
    try:
        tenant = await add_tenant(primary)
        tenant_id = tenant.tenant_id
        document_id = await add_document(primary, tenant_id)
        for version in range(1, VERSIONS + 1):
            chunks = [ChunkSpec(f"refund clause {n} of version {version}") for n in range(CHUNKS)]
            await add_version(primary, tenant_id, document_id, version, chunks, embedder)
        await point_search_at(primary, tenant_id, document_id, 1, embedder.model)
        await caught_up(primary_url, replica_url)

        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url=BASE_URL) as client:
            for version in range(2, VERSIONS + 1):
                paused = version % 2 == 0  # paused, replaying, paused, ...
                if paused:  # at the previous version, then stopped there
                    await caught_up(primary_url, replica_url)
                await _pause(replica, paused)
                await point_search_at(primary, tenant_id, document_id, version, embedder.model)
                status = await _status(client, tenant, document_id)
                assert status["searchVersion"] == version
                token = status["searchToken"]

                answer = await _search(client, tenant, [token])
                assert answer == {version}, f"token {token} answered from {answer}"
                if paused:
                    # The replica still serves the old version: without the token a search
                    # read there answers from it (what the token is for).
                    assert await _search_on(search, tenant.tenant_id) == {version - 1}
                    assert rotation.views()[0].in_rotation
    finally:
        await primary.close()
        await replica.close()
        await search.aclose()


async def test_a_delete_token_never_answers_with_the_document_on_any_server(
    replica_urls: tuple[str, str], replica_pools: tuple[Any, Any]
) -> None:
    """docs/architecture.md#document-lifecycle: the delete's searchToken is past its commit;
    a search naming it is answered only where the tombstone is replayed -- the primary while
    the replica is paused, the replica once it replayed it -- never with the document."""
    primary_url, replica_url = replica_urls
    primary_pool, replica_pool = replica_pools
    embedder = HashingEmbedder(64)
    settings = SearchSettings(database_url=primary_url, search_exact_max_chunks=10_000_000)
    rotation = one_replica_rotation(primary_pool, replica_pool, after_wait_seconds=0.2)
    await rotation.check()
    app, search = generation_search_app(primary_pool, settings, embedder, rotation=rotation)
    primary = await asyncpg.connect(primary_url)
    replica = await asyncpg.connect(replica_url)
    try:
        tenant = await add_tenant(primary)
        document_id = await add_document(primary, tenant.tenant_id)
        chunks = [ChunkSpec(f"refund clause {n} of version 1") for n in range(CHUNKS)]
        await add_version(primary, tenant.tenant_id, document_id, 1, chunks, embedder)
        await point_search_at(primary, tenant.tenant_id, document_id, 1, embedder.model)
        revision = await primary.fetchval(
            "SELECT revision FROM document WHERE document_id = $1", document_id
        )
        await caught_up(primary_url, replica_url)
        await _pause(replica, True)

        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url=BASE_URL) as client:
            assert await _search(client, tenant, []) == {1}
            response = await client.delete(
                tenant.path(f"/documents/{document_id}"),
                params={"revision": revision},
                headers=tenant.headers,
            )
            assert response.status_code == 200, response.text
            token = response.json()["searchToken"]
            # The paused replica has not replayed the delete: without the token a search read
            # there still finds the document (what the token is for)...
            assert await _search_on(search, tenant.tenant_id) == {1}
            # ...with it, the search waits, then is answered by the primary: nothing.
            assert await _search(client, tenant, [token]) == set()
            # A status read after the delete carries a token as safe as the delete's.
            status = await _status(client, tenant, document_id)
            assert status["indexStatus"] == "DELETED"
            assert await _search(client, tenant, [status["searchToken"]]) == set()

            await _pause(replica, False)
            await caught_up(primary_url, replica_url)
            assert await _search_on(search, tenant.tenant_id) == set()
            target = await rotation.choose(parse_token(token))
            assert target.name == REPLICA
            assert await _search(client, tenant, [token]) == set()
    finally:
        await primary.close()
        await replica.close()
        await search.aclose()


async def test_a_token_is_answered_by_the_replica_once_it_replayed_it(
    replica_urls: tuple[str, str], replica_pools: tuple[Any, Any]
) -> None:
    primary_url, replica_url = replica_urls
    primary_pool, replica_pool = replica_pools
    rotation = one_replica_rotation(primary_pool, replica_pool, after_wait_seconds=5.0)
    await rotation.check()
    primary = await asyncpg.connect(primary_url)
    replica = await asyncpg.connect(replica_url)
    try:
        await _pause(replica, True)
        await add_tenant(primary)
        token = await primary.fetchval("SELECT pg_current_wal_insert_lsn()::text")
        # Paused: the replica has not replayed the token; a wait of 0 reads the primary.
        quick = one_replica_rotation(primary_pool, replica_pool, after_wait_seconds=0)
        await quick.check()
        assert (await quick.choose(parse_token(token))).name == PRIMARY
        # Resumed while a search waits: the replica answers it.
        await _pause(replica, False)
        target = await rotation.choose(parse_token(token))
        assert target.name == REPLICA
        assert target.waited_seconds < 5.0
        assert await replica.fetchval("SELECT pg_last_wal_replay_lsn()") >= parse_token(token)
    finally:
        await primary.close()
        await replica.close()


async def test_a_paused_replica_leaves_the_rotation_and_comes_back(
    replica_urls: tuple[str, str], replica_pools: tuple[Any, Any]
) -> None:
    primary_url, replica_url = replica_urls
    primary_pool, replica_pool = replica_pools
    clock = SecondsClock()
    rotation = one_replica_rotation(
        primary_pool,
        replica_pool,
        max_lag_seconds=1.0,
        after_wait_seconds=0,
        check_seconds=0.5,
        clock=clock,
    )
    primary = await asyncpg.connect(primary_url)
    replica = await asyncpg.connect(replica_url)
    try:
        await rotation.check()
        assert (await rotation.choose()).name == REPLICA

        await _pause(replica, True)
        await add_tenant(primary)  # WAL the paused replica does not replay
        clock.now = 0.5
        await rotation.check()
        (view,) = rotation.views()
        # Within the limit: 0 (the primary wrote it only since the first check), or 0.5 when
        # the server's other databases wrote WAL the replica had not replayed at that check.
        assert view.in_rotation
        assert view.lag_seconds in (0.0, 0.5)
        await add_tenant(primary)
        clock.now = 2.0
        await rotation.check()
        (view,) = rotation.views()
        assert not view.in_rotation
        assert view.lag_seconds in (1.5, 2.0)
        assert (await rotation.choose()).name == PRIMARY

        await _pause(replica, False)
        await caught_up(primary_url, replica_url)
        clock.now = 2.5
        await rotation.check()
        (view,) = rotation.views()
        assert view.in_rotation
        assert view.lag_seconds == 0.0
        assert (await rotation.choose()).name == REPLICA
    finally:
        await primary.close()
        await replica.close()


async def test_a_search_the_replica_fails_is_answered_by_the_primary(
    replica_urls: tuple[str, str], replica_pools: tuple[Any, Any]
) -> None:
    primary_url, replica_url = replica_urls
    primary_pool, _ = replica_pools
    embedder = HashingEmbedder(64)
    settings = SearchSettings(database_url=primary_url, search_exact_max_chunks=10_000_000)
    gone = await open_search_pool(SearchSettings(database_url=replica_url))
    rotation = one_replica_rotation(primary_pool, gone, after_wait_seconds=0)
    await rotation.check()
    await gone.close()  # in rotation, and gone before the next check
    search = GenerationSearch(
        primary_pool, settings, embedder, lambda g: embedder, rotation=rotation
    )
    primary = await asyncpg.connect(primary_url)
    try:
        tenant = await add_tenant(primary)
        document_id = await add_document(primary, tenant.tenant_id)
        chunks = [ChunkSpec("refund clause of version 1")]
        await add_version(primary, tenant.tenant_id, document_id, 1, chunks, embedder)
        await point_search_at(primary, tenant.tenant_id, document_id, 1, embedder.model)
        from services.search.searcher import SearchRequest

        result = await search.search(
            SearchRequest(tenant.tenant_id, "refund clause", ("group:all",))
        )
        assert result.read_from == PRIMARY
        assert {hit.version_number for hit in result.results} == {1}
    finally:
        await primary.close()
        await search.aclose()


async def test_a_status_is_read_on_the_replica_and_on_the_primary_when_it_lags(
    replica_urls: tuple[str, str], replica_pools: tuple[Any, Any]
) -> None:
    primary_url, replica_url = replica_urls
    primary_pool, replica_pool = replica_pools
    embedder = HashingEmbedder(64)
    # A lag limit nobody reaches: the paused replica stays in rotation, so only the
    # fallback keeps a status of a document it lacks from being a 404.
    rotation = one_replica_rotation(primary_pool, replica_pool, after_wait_seconds=0)
    await rotation.check()
    app = create_publisher_app(
        PublisherSettings(database_url=primary_url),
        stores=PublisherStores(PgPublisherStore(primary_pool, status_replicas=rotation)),
    )
    registry = app.state.metrics.registry

    def reads(server: str) -> float:
        value = registry.get_sample_value("kb_publisher_status_reads_total", {"server": server})
        return value or 0.0

    primary = await asyncpg.connect(primary_url)
    replica = await asyncpg.connect(replica_url)
    try:
        tenant = await add_tenant(primary)
        replayed = await add_document(primary, tenant.tenant_id)
        chunks = [ChunkSpec("refund clause of version 1")]
        await add_version(primary, tenant.tenant_id, replayed, 1, chunks, embedder)
        await point_search_at(primary, tenant.tenant_id, replayed, 1, embedder.model)
        await caught_up(primary_url, replica_url)
        await _pause(replica, True)
        created_while_paused = await add_document(primary, tenant.tenant_id)

        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url=BASE_URL) as client:
            status = await _status(client, tenant, replayed)
            assert (reads(REPLICA), reads(PRIMARY)) == (1, 0)
            assert status["searchVersion"] == 1
            # The replica's token: a position it has received or replayed, so at or past the
            # switch (tests/security/test_search_slots.py shows why not the replayed alone).
            replica_reached = await replica.fetchval(
                "SELECT greatest(pg_last_wal_receive_lsn(), pg_last_wal_replay_lsn())::text"
            )
            assert parse_token(status["searchToken"]) <= parse_token(replica_reached)

            status = await _status(client, tenant, created_while_paused)
            assert status["documentId"] == str(created_while_paused)
            assert (reads(REPLICA), reads(PRIMARY)) == (1, 1)
            # Still on the replica, in rotation: it was asked first, and lacked the document.
            assert (
                await replica.fetchval(
                    "SELECT count(*) FROM document WHERE document_id = $1", created_while_paused
                )
                == 0
            )

            missing = await client.get(
                tenant.path(f"/documents/{uuid.uuid4()}"), headers=tenant.headers
            )
            assert missing.status_code == 404
    finally:
        await primary.close()
        await replica.close()


async def test_the_served_app_reads_status_on_its_search_replicas(
    replica_urls: tuple[str, str],
) -> None:
    """The wiring of services/app.py: KB_SEARCH_DATABASE_URLS reaches the status reads."""
    primary_url, replica_url = replica_urls
    app = create_app(
        PublisherSettings(database_url=primary_url),
        search_settings=SearchSettings(
            database_url=primary_url,
            search_database_urls=replica_url,
            search_replica_max_lag_seconds=3600,
            search_replica_check_seconds=0.05,
        ),
        embedding_settings=EmbeddingSettings(provider=HashingConfig(kind="hashing", dimensions=32)),
    )
    primary = await asyncpg.connect(primary_url)
    try:
        tenant = await add_tenant(primary)
        document_id = await add_document(primary, tenant.tenant_id)
        await caught_up(primary_url, replica_url)
        async with app.router.lifespan_context(app):
            # Polled: the rotation's first check runs in its own task and signals nothing.
            async with asyncio.timeout(5):
                while True:
                    if all(view.in_rotation for view in app.state.search_replicas()):
                        break
                    await asyncio.sleep(0.01)
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url=BASE_URL) as client:
                await _status(client, tenant, document_id)
            registry = app.state.metrics.registry
            servers = {
                sample.labels["server"]
                for metric in registry.collect()
                if metric.name == "kb_publisher_status_reads"
                for sample in metric.samples
                if sample.name.endswith("_total") and sample.value
            }
            assert servers == {replica_name(replica_url)}
    finally:
        await primary.close()


async def _status(client: httpx.AsyncClient, tenant: ApiTenant, document_id: uuid.UUID) -> Any:
    response = await client.get(tenant.path(f"/documents/{document_id}"), headers=tenant.headers)
    assert response.status_code == 200, response.text
    return response.json()


async def _search(client: httpx.AsyncClient, tenant: ApiTenant, after: list[str]) -> set[int]:
    response = await client.post(
        tenant.path("/search"),
        json={"query": "refund clause", "principals": ["group:all"], "after": after},
        headers=tenant.headers,
    )
    assert response.status_code == 200, response.text
    return {hit["versionNumber"] for hit in response.json()["results"]}


async def _search_on(search: GenerationSearch, tenant_id: str) -> set[int]:
    """A search without a token, read on the replica (the only one in rotation)."""
    from services.search.searcher import SearchRequest

    result = await search.search(SearchRequest(tenant_id, "refund clause", ("group:all",)))
    assert result.read_from == REPLICA
    return {hit.version_number for hit in result.results}


async def test_a_replica_that_does_not_catch_up_says_where_its_replay_stands(
    replica_urls: tuple[str, str],
) -> None:
    """A wait for the replica that times out names the replay's state (here: paused), so a
    failure on a loaded machine says why."""
    primary_url, replica_url = replica_urls
    replica = await asyncpg.connect(replica_url)
    primary = await asyncpg.connect(primary_url)
    try:
        await replica.execute("SELECT pg_wal_replay_pause()")
        await add_tenant(primary)  # WAL the paused replica does not replay
        with pytest.raises(TimeoutError, match=r"pause (paused|pause requested)"):
            await caught_up(primary_url, replica_url, timeout_s=0.5)
    finally:
        await replica.execute("SELECT pg_wal_replay_resume()")
        await replica.close()
        await primary.close()
