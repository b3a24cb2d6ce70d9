"""One contract for both publisher stores: the PostgreSQL adapter and the in-memory fake.

The publisher's rules run through :class:`Publisher` on each store; a probe arranges and
inspects what lives outside the publisher's port (tenants, the indexer's side, the outbox).
"""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias

import asyncpg
import pytest

from services.publisher.domain import (
    Publisher,
    RevisionConflict,
    Upload,
)
from services.publisher.ports import PublisherStore
from services.publisher.store_pg import PgPublisherStore, PgTenantStore
from services.runtime.auth.keys import Scope
from services.runtime.errors import Conflict, NotFound
from tests.fakes.publisher_store import MemoryPublisherStore

KEY_HASH = hashlib.sha256(b"key of acme").digest()


class Probe(Protocol):
    async def add_tenant(self, tenant_id: str, tier: str, key_hash: bytes) -> None: ...
    async def event_types(self) -> list[str]: ...
    async def finish_task(
        self, task_id: uuid.UUID, status: str, error_code: str | None
    ) -> None: ...
    async def switch_search_version(
        self, tenant_id: str, document_id: uuid.UUID, version: int, task_id: uuid.UUID
    ) -> None: ...


@dataclass
class MemoryProbe:
    store: MemoryPublisherStore

    async def add_tenant(self, tenant_id: str, tier: str, key_hash: bytes) -> None:
        self.store.add_tenant(tenant_id, tier, key_hash)

    async def event_types(self) -> list[str]:
        return [e.event_type for e in self.store.events()]

    async def finish_task(self, task_id: uuid.UUID, status: str, error_code: str | None) -> None:
        self.store.finish_task(task_id, status, error_code=error_code, error_message="m")

    async def switch_search_version(
        self, tenant_id: str, document_id: uuid.UUID, version: int, task_id: uuid.UUID
    ) -> None:
        self.store.switch_search_version(tenant_id, document_id, version)


@dataclass
class PgProbe:
    conn: asyncpg.Connection[Any]

    async def add_tenant(self, tenant_id: str, tier: str, key_hash: bytes) -> None:
        await PgTenantStore(self.conn).create_tenant(tenant_id, tier, key_hash)

    async def event_types(self) -> list[str]:
        return [r["event_type"] for r in await self.conn.fetch("SELECT * FROM outbox ORDER BY 1")]

    async def finish_task(self, task_id: uuid.UUID, status: str, error_code: str | None) -> None:
        await self.conn.execute(
            "UPDATE index_task SET status = $2, error_code = $3, error_message = 'm',"
            " finished_at = now() WHERE task_id = $1",
            task_id,
            status,
            error_code,
        )

    async def switch_search_version(
        self, tenant_id: str, document_id: uuid.UUID, version: int, task_id: uuid.UUID
    ) -> None:
        await self.conn.execute(
            "INSERT INTO document_search_version (tenant_id, document_id, version_number,"
            " embedding_model, task_id) VALUES ($1, $2, $3, 'm', $4)",
            tenant_id,
            document_id,
            version,
            task_id,
        )


@dataclass
class Subject:
    store: PublisherStore
    probe: Probe
    publisher: Publisher


PgBackend: TypeAlias = "tuple[asyncpg.Pool[Any], asyncpg.Connection[Any]]"


@pytest.fixture(params=["memory", pytest.param("postgres", marks=pytest.mark.integration)])
def backend(request: pytest.FixtureRequest) -> PgBackend | None:
    """None for the fake; a pool and a connection on a fresh migrated database for PostgreSQL
    (only that run needs the servers). A sync fixture, so the session stack starts outside
    the event loop."""
    if request.param == "memory":
        return None
    return request.getfixturevalue("pool"), request.getfixturevalue("conn")


@pytest.fixture
async def subject(backend: PgBackend | None) -> Subject:
    store: PublisherStore
    probe: Probe
    if backend is None:
        memory = MemoryPublisherStore()
        store, probe = memory, MemoryProbe(memory)
    else:
        pool, conn = backend
        store, probe = PgPublisherStore(pool), PgProbe(conn)
    await probe.add_tenant("acme", "standard", KEY_HASH)
    await probe.add_tenant("globex", "premium", hashlib.sha256(b"globex").digest())
    return Subject(store, probe, Publisher(store, max_upload_bytes=1024))


def _upload(text: bytes = b"hello") -> Upload:
    return Upload(text, "text/plain", "a.txt")


async def test_keys_are_checked_within_their_tenant(subject: Subject) -> None:
    grant = await subject.store.api_key("acme", KEY_HASH)
    assert grant is not None
    assert grant.allows(Scope.ADMIN)  # a tenant's first key
    assert await subject.store.api_key("globex", KEY_HASH) is None
    assert await subject.store.api_key("acme", hashlib.sha256(b"x").digest()) is None


async def test_upload_publish_repeat_and_status(subject: Subject) -> None:
    publisher, probe = subject.publisher, subject.probe
    created = await publisher.create_document("acme", "Title", _upload())
    assert (created.version_number, created.revision) == (1, 1)
    status = await publisher.document_status("acme", created.document_id)
    assert status.index_status == "NOT_PUBLISHED"

    first = await publisher.publish(
        "acme", created.document_id, 1, expected_revision=1, read_principals=["a"]
    )
    assert (first.revision, first.changed) == (2, True)
    again = await publisher.publish(
        "acme", created.document_id, 1, expected_revision=1, read_principals=["a"]
    )
    assert (again.revision, again.index_task_id, again.changed) == (2, first.index_task_id, False)
    assert await probe.event_types() == ["IndexTaskCreated", "DocumentVersionPublished"]

    task = await publisher.index_task("acme", first.index_task_id)
    assert (task.status, task.tier, task.version_number) == ("PENDING", "standard", 1)
    status = await publisher.document_status("acme", created.document_id)
    assert (status.index_status, status.index_task_id) == ("INDEXING", first.index_task_id)

    await probe.switch_search_version("acme", created.document_id, 1, first.index_task_id)
    await probe.finish_task(first.index_task_id, "SUCCEEDED", None)
    assert (await publisher.document_status("acme", created.document_id)).index_status == (
        "SEARCHABLE"
    )

    added = await publisher.add_version("acme", created.document_id, _upload(b"v2"))
    assert (added.version_number, added.revision) == (2, 3)
    second = await publisher.publish(
        "acme", created.document_id, 2, expected_revision=3, read_principals=["a"]
    )
    await probe.finish_task(second.index_task_id, "DEAD", "DOCUMENT_PARSE_FAILED")
    status = await publisher.document_status("acme", created.document_id)
    assert status.index_status == "FAILED"
    assert status.failure is not None
    assert status.failure.error_code == "DOCUMENT_PARSE_FAILED"
    assert (status.published_version, status.search_version) == (2, 1)


async def test_conflicts_and_lookups_change_nothing(subject: Subject) -> None:
    publisher, probe = subject.publisher, subject.probe
    created = await publisher.create_document("acme", "Title", _upload())
    with pytest.raises(RevisionConflict) as stale:
        await publisher.publish(
            "acme", created.document_id, 1, expected_revision=7, read_principals=[]
        )
    assert stale.value.current_revision == 1
    with pytest.raises(NotFound):
        await publisher.publish(
            "acme", created.document_id, 2, expected_revision=1, read_principals=[]
        )
    # Another tenant never sees it.
    with pytest.raises(NotFound):
        await publisher.document_status("globex", created.document_id)
    with pytest.raises(NotFound):
        await publisher.add_version("globex", created.document_id, _upload())
    assert await probe.event_types() == []

    await publisher.add_version("acme", created.document_id, _upload(b"v2"))
    done = await publisher.publish(
        "acme", created.document_id, 2, expected_revision=2, read_principals=[]
    )
    with pytest.raises(NotFound):
        await publisher.index_task("globex", done.index_task_id)
    with pytest.raises(Conflict) as superseded:
        await publisher.publish(
            "acme", created.document_id, 1, expected_revision=3, read_principals=[]
        )
    assert superseded.value.code == "VERSION_SUPERSEDED"
    assert len(await probe.event_types()) == 2


async def test_a_failed_transaction_leaves_nothing(subject: Subject) -> None:
    document_id = uuid.uuid4()

    class Boom(Exception):
        pass

    with pytest.raises(Boom):
        async with subject.store.transaction("acme") as tx:
            await tx.insert_document("acme", document_id, "t", None)
            raise Boom
    assert await subject.store.document_status("acme", document_id) is None


async def test_delete_is_final_idempotent_and_ends_the_tasks(subject: Subject) -> None:
    publisher, probe = subject.publisher, subject.probe
    created = await publisher.create_document("acme", "Title", _upload())
    published = await publisher.publish(
        "acme", created.document_id, 1, expected_revision=1, read_principals=["a"]
    )
    with pytest.raises(NotFound):
        await publisher.delete_document("globex", created.document_id, expected_revision=2)
    with pytest.raises(RevisionConflict):
        await publisher.delete_document("acme", created.document_id, expected_revision=1)
    assert await probe.event_types() == ["IndexTaskCreated", "DocumentVersionPublished"]

    deleted = await publisher.delete_document("acme", created.document_id, expected_revision=2)
    assert (deleted.revision, deleted.changed) == (3, True)
    assert deleted.search_token
    again = await publisher.delete_document("acme", created.document_id, expected_revision=2)
    assert (again.revision, again.deleted_at, again.changed) == (3, deleted.deleted_at, False)
    assert (await probe.event_types())[2:] == ["DocumentDeleted"]

    task = await publisher.index_task("acme", published.index_task_id)
    assert (task.status, task.error_code) == ("DEAD", "DOCUMENT_DELETED")
    status = await publisher.document_status("acme", created.document_id)
    assert (status.index_status, status.deleted_at) == ("DELETED", deleted.deleted_at)
    assert (status.failure, status.index_task_id, status.search_version) == (None, None, None)

    for change in (
        publisher.publish(
            "acme", created.document_id, 1, expected_revision=3, read_principals=["b"]
        ),
        publisher.add_version("acme", created.document_id, _upload(b"v2")),
    ):
        with pytest.raises(Conflict) as refused:
            await change
        assert refused.value.code == "DOCUMENT_DELETED"
    assert len(await probe.event_types()) == 3
