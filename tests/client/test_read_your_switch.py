"""Read-your-switch through a paused replica without the caller knowing tokens exist
(issue 45): the server searches on a streaming replica whose replay is paused (kept in
rotation: its lag allowance is an hour). A document published and waited for with
`publish_file` is found by the same client's next search -- the client passes the token its
wait returned as `after`, so the search is not answered by the replica that has not replayed
it -- while a client that was handed no token searches the stale replica and finds nothing."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator

import asyncpg
import pytest
from kb_client import AsyncKbClient, SearchMode

from services.search.statements import SearchSettings
from tests.client.conftest import indexing, serving
from tests.support.api import ApiTenant, add_tenant
from tests.support.replica import ReplicaPair, caught_up, replica_database

pytestmark = pytest.mark.integration

READ = ["group:all"]
WAIT = 120.0


@pytest.fixture(scope="module")
async def primary(replica_pair: ReplicaPair) -> AsyncIterator[str]:
    async with replica_database(replica_pair) as url:
        yield url


@pytest.fixture(scope="module")
def replica_server(replica_pair: ReplicaPair, primary: str) -> Iterator[str]:
    search = SearchSettings(
        database_url=primary,
        search_database_urls=replica_pair.replica_url(primary),
        search_replica_max_lag_seconds=3600,
        # Also each check's timeout: a check that times out takes the replica out of
        # rotation, and a search without a token would then read the primary. A second is
        # far above a local read even on a loaded machine.
        search_replica_check_seconds=1.0,
        search_after_wait_seconds=0.2,
    )
    with serving(primary, search_settings=search) as url:
        yield url


@contextlib.asynccontextmanager
async def paused(replica_url: str) -> AsyncIterator[None]:
    replica = await asyncpg.connect(replica_url)
    try:
        await replica.execute("SELECT pg_wal_replay_pause()")
        yield
    finally:
        await replica.execute("SELECT pg_wal_replay_resume()")
        await replica.close()


async def _tenant(primary: str) -> ApiTenant:
    conn = await asyncpg.connect(primary)
    try:
        return await add_tenant(conn)
    finally:
        await conn.close()


async def test_a_search_after_a_wait_sees_the_version_a_paused_replica_has_not(
    integration_only: None, replica_pair: ReplicaPair, primary: str, replica_server: str
) -> None:
    replica_url = replica_pair.replica_url(primary)
    tenant = await _tenant(primary)
    async with indexing(primary):
        # The tenant, its key and the indexer's generation are on the replica before it
        # stops (a replica just started may first replay what the primary wrote meanwhile).
        await caught_up(primary, replica_url, timeout_s=300)
        async with paused(replica_url), AsyncKbClient(replica_server, tenant.key) as kb:
            published = await kb.publish_file(
                b"# Returns\n\nA parcel may be returned within forty days.\n",
                filename="returns.md",
                read=READ,
                timeout=WAIT,
            )
            assert published.search_token is not None
            found = await kb.search("parcel returned", principals=READ, mode=SearchMode.KEYWORD)
            async with AsyncKbClient(replica_server, tenant.key) as unaware:
                stale = await unaware.search(
                    "parcel returned", principals=READ, mode=SearchMode.KEYWORD
                )
    assert [h.document_id for h in found.results] == [published.document_id]
    # The replica never replayed the document: a search without the token reads it there.
    assert stale.results == []
