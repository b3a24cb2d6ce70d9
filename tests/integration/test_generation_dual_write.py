"""The publisher's dual write (docs/architecture.md#index-generations) over the real API and
PostgreSQL: a publish on a tenant built in a generation beside its serving one enqueues a task
for each (the serving one's with no generation named, the other's naming it, both at a
publish's priority), single and bulk alike; a tenant built in no other generation gets one
task as before; and a publish never misses a generation being created meanwhile."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from services.runtime.indexing.tasks import enqueue_generation_tasks, find_index_task
from services.runtime.settings import RuntimeSettings
from tests.support.api import ApiTenant, Harness, add_tenant, publish, publisher_harness, upload
from tests.support.locks import wait_until_blocked_on_a_lock

pytestmark = pytest.mark.integration


@pytest.fixture
async def api(settings: RuntimeSettings) -> AsyncIterator[Harness]:
    async with publisher_harness(settings, max_upload_bytes=64 * 1024) as harness:
        yield harness


@pytest.fixture
async def acme(conn: asyncpg.Connection[Any]) -> ApiTenant:
    return await add_tenant(conn, "acme", "standard")


async def add_generation(conn: asyncpg.Connection[Any], model: str, state: str = "ACTIVE") -> int:
    generation_id: int = await conn.fetchval(
        "INSERT INTO search_generation (provider_profile, embedding_model, dimension,"
        " chunk_max_tokens, chunk_overlap_tokens, state)"
        " VALUES ('default', $1, 8, 64, 0, $2) RETURNING generation_id",
        model,
        state,
    )
    return generation_id


async def build_in(
    conn: asyncpg.Connection[Any], tenant_id: str, serving: int, *beside: int
) -> None:
    await conn.execute(
        "INSERT INTO tenant_search_generation (tenant_id, generation_id, serving)"
        " VALUES ($1, $2, true)",
        tenant_id,
        serving,
    )
    for generation_id in beside:
        await conn.execute(
            "INSERT INTO tenant_search_generation (tenant_id, generation_id) VALUES ($1, $2)",
            tenant_id,
            generation_id,
        )


async def tasks_of(conn: asyncpg.Connection[Any], document_id: str) -> set[tuple[Any, ...]]:
    rows = await conn.fetch(
        "SELECT version_number, generation_id, priority, status FROM index_task"
        " WHERE document_id = $1",
        uuid.UUID(document_id),
    )
    return {tuple(row) for row in rows}


async def published_draft(api: Harness, tenant: ApiTenant) -> str:
    created = (await upload(api.client, tenant)).json()
    response = await publish(api.client, tenant, created["documentId"], 1, created["revision"])
    assert response.status_code == 202, response.text
    document_id: str = created["documentId"]
    return document_id


async def test_a_publish_enqueues_a_task_per_generation_being_built(
    api: Harness, acme: ApiTenant, conn: asyncpg.Connection[Any]
) -> None:
    serving = await add_generation(conn, "hashing-v1-8")
    building = await add_generation(conn, "hashing-v1-16")
    retiring = await add_generation(conn, "hashing-v1-24", state="RETIRING")
    await build_in(conn, "acme", serving, building, retiring)

    document_id = await published_draft(api, acme)
    assert await tasks_of(conn, document_id) == {
        (1, None, 0, "PENDING"),
        (1, building, 0, "PENDING"),
    }
    # The document's status names the serving generation's task, the one the publish
    # answered with.
    status = await api.client.get(acme.path(f"/documents/{document_id}"), headers=acme.headers)
    assert status.status_code == 200, status.text
    task_id = await find_index_task(conn, "acme", uuid.UUID(document_id), 1)
    assert status.json()["indexTaskId"] == str(task_id)
    # One IndexTaskCreated event, as before: it wakes the tier's indexers for both.
    events = await conn.fetch("SELECT event_type FROM outbox WHERE event_type = 'IndexTaskCreated'")
    assert len(events) == 1


async def test_a_tenant_built_in_no_other_generation_gets_one_task(
    api: Harness, acme: ApiTenant, conn: asyncpg.Connection[Any]
) -> None:
    other_tenant = await add_tenant(conn, "globex", "standard")
    serving = await add_generation(conn, "hashing-v1-8")
    building = await add_generation(conn, "hashing-v1-16")
    await build_in(conn, "globex", serving, building)  # another tenant's generations

    document_id = await published_draft(api, acme)
    assert await tasks_of(conn, document_id) == {(1, None, 0, "PENDING")}
    assert other_tenant.tenant_id == "globex"


async def test_a_bulk_publish_enqueues_a_task_per_generation_being_built(
    api: Harness, acme: ApiTenant, conn: asyncpg.Connection[Any]
) -> None:
    serving = await add_generation(conn, "hashing-v1-8")
    building = await add_generation(conn, "hashing-v1-16")
    await build_in(conn, "acme", serving, building)

    items = [{"title": f"Policy {n}", "acl": {"read": ["group:all"]}} for n in range(3)]
    parts: list[tuple[str, Any]] = [("items", (None, json.dumps(items), "application/json"))]
    parts += [("file", (f"p{n}.txt", f"policy {n}".encode(), "text/plain")) for n in range(3)]
    response = await api.client.post(
        acme.path("/documents/bulk"), files=parts, headers=acme.headers
    )
    assert response.status_code == 200, response.text
    documents = [r["documentId"] for r in response.json()["results"]]
    assert len(documents) == 3
    for document_id in documents:
        assert await tasks_of(conn, document_id) == {
            (1, None, 0, "PENDING"),
            (1, building, 0, "PENDING"),
        }


async def test_a_publish_waits_for_a_generation_being_created(
    acme: ApiTenant, conn: asyncpg.Connection[Any], database_url: str
) -> None:
    """`create` adds the tenant's rows under the exclusive advisory lock: a publish that
    reads the tenant's generations meanwhile waits, then sees the new generation."""
    serving = await add_generation(conn, "hashing-v1-8")
    building = await add_generation(conn, "hashing-v1-16")
    await conn.execute(
        "INSERT INTO tenant_search_generation (tenant_id, generation_id, serving)"
        " VALUES ('acme', $1, true)",
        serving,
    )
    document_id = await conn.fetchval(
        "INSERT INTO document (tenant_id, document_id, title, latest_version, published_version)"
        " VALUES ('acme', gen_random_uuid(), 'd', 1, 1) RETURNING document_id"
    )
    await conn.execute(
        "INSERT INTO document_version (tenant_id, document_id, version_number, content,"
        " media_type, sha256, size_bytes, status)"
        " VALUES ('acme', $1, 1, 'x', 'text/plain', sha256('x'), 1, 'PUBLISHED')",
        document_id,
    )
    creator = await asyncpg.connect(database_url)
    publisher = await asyncpg.connect(database_url)
    try:
        create = creator.transaction()
        await create.start()
        await creator.execute(
            "SELECT pg_advisory_xact_lock(hashtextextended('kb.search_generation', 0))"
        )
        await creator.execute(
            "INSERT INTO tenant_search_generation (tenant_id, generation_id) VALUES ('acme', $1)",
            building,
        )

        async def dual_write() -> list[uuid.UUID]:
            async with publisher.transaction():
                return await enqueue_generation_tasks(
                    publisher, tenant_id="acme", tier="standard", versions=[(document_id, 1)]
                )

        publishing = asyncio.create_task(dual_write())
        await wait_until_blocked_on_a_lock(conn)
        assert not publishing.done()
        await create.commit()
        assert len(await publishing) == 1
        generation = await conn.fetchval(
            "SELECT generation_id FROM index_task WHERE document_id = $1", document_id
        )
        assert generation == building
    finally:
        await creator.close()
        await publisher.close()
