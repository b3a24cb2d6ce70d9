"""The READ ACL belongs to the version (issue 29, item 1; migration 0024): a version's ACL
takes effect for search when that version becomes the served one, in the pointer switch's
transaction (the sink's, or `kb index generations switch`'s); a new ACL for the version
already served applies at once. Over the real publisher API, queue, pipeline, sink and
search, on PostgreSQL."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from services.indexer.generations.store_pg import PgGenerations
from services.indexer.queue.store_pg import PgTaskQueue
from services.indexer.queue.worker import RunOnceResult, Worker
from services.indexer.retry import RetryPolicy
from services.runtime.settings import RuntimeSettings
from services.runtime.tenancy.served_acl import apply_served_acl, lock_first_pointer
from tests.support.api import ApiTenant, add_tenant, publish, upload
from tests.support.documents import make_corrupt_pdf
from tests.support.generations import (
    add_document,
    build,
    new_generation,
    pointers,
    register_default,
)
from tests.support.locks import wait_until_blocked_on_a_lock
from tests.support.pipeline import running_pipeline
from tests.support.search import SearchHarness, search_harness

pytestmark = pytest.mark.integration

HR_ONLY = "Salary bands: the HR handbook lists every grade and its pay range."
PUBLIC = "Careers: we hire engineers and designers all year round."
QUERY_V1 = "salary bands grade pay"
QUERY_V2 = "careers hire engineers designers"


@pytest.fixture
async def api(settings: RuntimeSettings) -> AsyncIterator[SearchHarness]:
    async with search_harness(settings) as harness:
        yield harness


@pytest.fixture
async def acme(conn: asyncpg.Connection[Any]) -> ApiTenant:
    return await add_tenant(conn, "acme", "standard")


class Document:
    """One document of the tenant, through the publisher's API, tracking its revision."""

    def __init__(self, api: SearchHarness, tenant: ApiTenant) -> None:
        self.api, self.tenant = api, tenant
        self.id: uuid.UUID | None = None
        self.revision = 0

    async def upload(
        self, content: bytes, *, media_type: str = "text/plain", filename: str = "doc.txt"
    ) -> int:
        response = await upload(
            self.api.client,
            self.tenant,
            content,
            media_type=media_type,
            filename=filename,
            document_id=self.id,
        )
        assert response.status_code == 201, response.text
        body = response.json()
        self.id, self.revision = uuid.UUID(body["documentId"]), body["revision"]
        version: int = body["versionNumber"]
        return version

    async def publish(self, version: int, read: list[str]) -> None:
        assert self.id is not None
        response = await publish(
            self.api.client, self.tenant, self.id, version, self.revision, read=read
        )
        assert response.status_code == 202, response.text
        self.revision = response.json()["revision"]


async def found(api: SearchHarness, tenant: ApiTenant, query: str, principal: str) -> set[int]:
    """The versions a search as ``principal`` returns chunks of, in every mode."""
    versions: set[int] = set()
    for mode in ("hybrid", "vector", "keyword"):
        response = await api.search(
            tenant, {"query": query, "principals": [principal], "mode": mode, "topK": 10}
        )
        assert response.status_code == 200, response.text
        versions |= {r["versionNumber"] for r in response.json()["results"]}
    return versions


def worker(pool: asyncpg.Pool[Any], indexer: Any) -> Worker:
    return Worker(
        PgTaskQueue(pool),
        indexer,
        tier="standard",
        owner="it-version-acl",
        policy=RetryPolicy(jitter=0),
    )


async def served_acl(conn: asyncpg.Connection[Any], document_id: uuid.UUID) -> set[str]:
    rows = await conn.fetch(
        "SELECT principal FROM document_acl WHERE document_id = $1", document_id
    )
    return {row["principal"] for row in rows}


async def test_a_wider_acl_waits_for_its_version_and_a_dead_v2_leaks_nothing(
    api: SearchHarness,
    acme: ApiTenant,
    pool: asyncpg.Pool[Any],
    conn: asyncpg.Connection[Any],
) -> None:
    doc = Document(api, acme)
    async with running_pipeline(pool) as indexer:
        v1 = await doc.upload(HR_ONLY.encode())
        await doc.publish(v1, ["group:hr"])
        assert await worker(pool, indexer).run_once() is RunOnceResult.SUCCEEDED
        assert await found(api, acme, QUERY_V1, "group:hr") == {1}
        assert await found(api, acme, QUERY_V1, "everyone") == set()

        # v2, a public rewrite, published with read `everyone`: v1 is still the one served,
        # and its ACL still applies.
        v2 = await doc.upload(
            make_corrupt_pdf(), media_type="application/pdf", filename="careers.pdf"
        )
        await doc.publish(v2, ["everyone"])
        assert await found(api, acme, QUERY_V1, "everyone") == set()
        assert await found(api, acme, QUERY_V1, "group:hr") == {1}

        # v2 never indexes (a corrupt file): still nothing of v1 for everyone.
        assert await worker(pool, indexer).run_once() is RunOnceResult.FAILED
    assert doc.id is not None
    assert (
        await conn.fetchval(
            "SELECT status FROM index_task WHERE document_id = $1 AND version_number = 2",
            doc.id,
        )
        == "DEAD"
    )
    assert await found(api, acme, QUERY_V1, "everyone") == set()
    assert await found(api, acme, QUERY_V1, "group:hr") == {1}
    assert await served_acl(conn, doc.id) == {"group:hr"}


async def test_the_acl_of_v2_applies_when_v2_is_served(
    api: SearchHarness,
    acme: ApiTenant,
    pool: asyncpg.Pool[Any],
    conn: asyncpg.Connection[Any],
) -> None:
    doc = Document(api, acme)
    async with running_pipeline(pool) as indexer:
        v1 = await doc.upload(HR_ONLY.encode())
        await doc.publish(v1, ["group:hr"])
        assert await worker(pool, indexer).run_once() is RunOnceResult.SUCCEEDED
        v2 = await doc.upload(PUBLIC.encode())
        await doc.publish(v2, ["everyone"])
        assert await found(api, acme, QUERY_V2, "everyone") == set()

        assert await worker(pool, indexer).run_once() is RunOnceResult.SUCCEEDED

    assert await found(api, acme, QUERY_V2, "everyone") == {2}
    assert await found(api, acme, QUERY_V1, "everyone") <= {2}  # never v1's chunks
    # HR's rule was v1's: gone with it.
    assert await found(api, acme, QUERY_V2, "group:hr") == set()
    assert doc.id is not None
    assert await served_acl(conn, doc.id) == {"everyone"}


async def test_a_new_acl_for_the_served_version_applies_at_once(
    api: SearchHarness,
    acme: ApiTenant,
    pool: asyncpg.Pool[Any],
    conn: asyncpg.Connection[Any],
) -> None:
    doc = Document(api, acme)
    async with running_pipeline(pool) as indexer:
        v1 = await doc.upload(HR_ONLY.encode())
        await doc.publish(v1, ["group:hr"])
        assert await worker(pool, indexer).run_once() is RunOnceResult.SUCCEEDED

    # An ACL-only re-publish of the served version: widened, then narrowed, each at once.
    await doc.publish(v1, ["group:hr", "group:finance"])
    assert await found(api, acme, QUERY_V1, "group:finance") == {1}
    assert await found(api, acme, QUERY_V1, "group:hr") == {1}
    await doc.publish(v1, ["group:finance"])
    assert await found(api, acme, QUERY_V1, "group:hr") == set()
    assert await found(api, acme, QUERY_V1, "group:finance") == {1}

    # A new ACL for a published version not yet served changes nothing served.
    v2 = await doc.upload(PUBLIC.encode())
    await doc.publish(v2, ["everyone"])
    await doc.publish(v2, ["everyone", "group:hr"])
    assert await found(api, acme, QUERY_V1, "everyone") == set()
    assert await found(api, acme, QUERY_V1, "group:hr") == set()
    assert doc.id is not None
    assert await served_acl(conn, doc.id) == {"group:finance"}


async def _version_acl(
    pool: asyncpg.Pool[Any], tenant_id: str, document_id: uuid.UUID, version: int, read: list[str]
) -> None:
    await pool.execute(
        "INSERT INTO document_version_acl (tenant_id, document_id, version_number, principal,"
        " permission) SELECT $1, $2, $3, p, 'READ' FROM unnest($4::text[]) AS p",
        tenant_id,
        document_id,
        version,
        read,
    )


async def test_a_generations_switch_that_moves_a_pointer_applies_that_versions_acl(
    pool: asyncpg.Pool[Any],
) -> None:
    await register_default(pool)
    # Served at v1 (HR only), v2 published with read `everyone`; and a document the new
    # generation holds at the version already served; and one with no pointer yet.
    moved = await add_document(pool, "acme", served=1, published=2)
    kept = await add_document(pool, "acme", served=1, published=1)
    unserved = await add_document(pool, "acme", served=None, published=1)
    for doc, version, read in (
        (moved, 1, ["group:hr"]),
        (moved, 2, ["everyone"]),
        (kept, 1, ["group:hr"]),
        (unserved, 1, ["group:sales"]),
    ):
        await _version_acl(pool, "acme", doc.document_id, version, read)
    for doc in (moved, kept):
        await pool.execute(
            "INSERT INTO document_acl (tenant_id, document_id, principal, permission)"
            " VALUES ('acme', $1, 'group:hr', 'READ')",
            doc.document_id,
        )
    g = await new_generation(pool, ["acme"])
    await build(pool, moved, g, version=2)
    await build(pool, kept, g, version=1)
    await build(pool, unserved, g, version=1)

    outcome = await PgGenerations(pool).switch("acme", g, force=False)

    assert outcome.rewritten == 2
    served = await pointers(pool, "acme")
    assert {d: v[0] for d, v in served.items()} == {
        moved.document_id: 2,
        kept.document_id: 1,
        unserved.document_id: 1,
    }
    acl = await pool.fetch(
        "SELECT document_id, principal FROM document_acl WHERE tenant_id = 'acme'"
    )
    assert {(r["document_id"], r["principal"]) for r in acl} == {
        (moved.document_id, "everyone"),
        (kept.document_id, "group:hr"),
        (unserved.document_id, "group:sales"),
    }


async def _switch_held_open(
    database_url: str, doc: Document, version: int, *, first: bool
) -> asyncpg.Connection[Any]:
    """A completion's switch of ``doc`` to ``version``, as the sink does it (the pointer row
    locked, or the stand-in lock of a first pointer, the pointer moved, the version's ACL
    applied), left uncommitted on a connection of its own."""
    assert doc.id is not None
    switch = await asyncpg.connect(database_url)
    await switch.execute("BEGIN")
    if first:
        await lock_first_pointer(switch, "acme", [doc.id])
        await switch.execute(
            "INSERT INTO document_search_version (tenant_id, document_id, version_number,"
            " embedding_model) VALUES ('acme', $1, $2, 'm')",
            doc.id,
            version,
        )
    else:
        await switch.execute(
            "SELECT 1 FROM document_search_version WHERE tenant_id = 'acme'"
            " AND document_id = $1 FOR UPDATE",
            doc.id,
        )
        await switch.execute(
            "UPDATE document_search_version SET version_number = $2"
            " WHERE tenant_id = 'acme' AND document_id = $1",
            doc.id,
            version,
        )
    await apply_served_acl(switch, "acme", [doc.id])
    return switch


@pytest.mark.parametrize("first", [False, True], ids=["moved_pointer", "first_pointer"])
async def test_a_publish_racing_the_switch_to_its_version_applies_its_acl(
    api: SearchHarness,
    acme: ApiTenant,
    pool: asyncpg.Pool[Any],
    conn: asyncpg.Connection[Any],
    database_url: str,
    first: bool,
) -> None:
    """A new ACL for the version a switch is moving the pointer to, published while that
    switch is uncommitted: the publish waits for it (the pointer row, or the stand-in lock of
    a first pointer) and then applies its ACL itself; else the switch's copy of the old ACL
    would stay the served one."""
    doc = Document(api, acme)
    v1 = await doc.upload(HR_ONLY.encode())
    await doc.publish(v1, ["group:hr"])
    assert doc.id is not None
    if first:
        target = v1
    else:
        async with running_pipeline(pool) as indexer:
            assert await worker(pool, indexer).run_once() is RunOnceResult.SUCCEEDED
        target = await doc.upload(PUBLIC.encode())
        await doc.publish(target, ["everyone"])
    old = {"group:hr"} if first else {"everyone"}
    switch = await _switch_held_open(database_url, doc, target, first=first)
    try:
        # The switch is not committed: what was served before it (nothing, or v1's ACL).
        assert await served_acl(conn, doc.id) == (set() if first else {"group:hr"})
        publishing = asyncio.create_task(doc.publish(target, [*old, "group:finance"]))
        await wait_until_blocked_on_a_lock(conn)
        await switch.execute("COMMIT")
        await publishing
    finally:
        await switch.close()
    assert await served_acl(conn, doc.id) == {*old, "group:finance"}


async def test_a_publish_and_a_completion_of_one_document_do_not_deadlock(
    api: SearchHarness,
    acme: ApiTenant,
    conn: asyncpg.Connection[Any],
    database_url: str,
) -> None:
    """One lock order (issue 29): a completion holds its task row, then writes rows whose
    foreign keys name the document (the first pointer, the served ACL); a publish of the
    same version's ACL holds the document row and waits for the task's key. The publish's
    document lock does not block those foreign key checks, so the completion commits, then
    the publish applies its ACL over the completion's."""
    doc = Document(api, acme)
    v1 = await doc.upload(HR_ONLY.encode())
    await doc.publish(v1, ["group:hr"])
    assert doc.id is not None
    completion = await asyncpg.connect(database_url)
    try:
        await completion.execute("BEGIN")
        await completion.execute(
            "UPDATE index_task SET status = 'SUCCEEDED', finished_at = now()"
            " WHERE document_id = $1 AND version_number = 1",
            doc.id,
        )
        publishing = asyncio.create_task(doc.publish(v1, ["group:hr", "group:finance"]))
        await wait_until_blocked_on_a_lock(conn)  # on the task's key
        await lock_first_pointer(completion, "acme", [doc.id])
        await completion.execute(
            "INSERT INTO document_search_version (tenant_id, document_id, version_number,"
            " embedding_model) VALUES ('acme', $1, 1, 'm')",
            doc.id,
        )
        await apply_served_acl(completion, "acme", [doc.id])
        await completion.execute("COMMIT")
        await asyncio.wait_for(publishing, 30)
    finally:
        await completion.close()
    assert await served_acl(conn, doc.id) == {"group:hr", "group:finance"}
