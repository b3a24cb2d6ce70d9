"""The erase's order of work in the publisher, on the in-memory store: erase implies delete
(one DocumentDeleted, never two), the batches run only while the audit row says "in
progress", a repeat writes nothing, and a publisher without an erasure store refuses with a
stable code instead of deleting without erasing."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import replace
from datetime import UTC, datetime

import pytest

from services.publisher.domain import EraseUnavailable, Publisher, Upload
from services.publisher.ports import ErasureRequest
from tests.fakes.publisher_store import MemoryPublisherStore

AT = datetime(2026, 12, 6, 18, 0, tzinfo=UTC)


class CountingErasure:
    def __init__(self, store: MemoryPublisherStore) -> None:
        self.store = store
        self.runs = 0

    async def erase_content(
        self, tenant_id: str, document_id: uuid.UUID, *, batch_rows: int, now: datetime | None
    ) -> datetime:
        self.runs += 1
        key = (tenant_id, document_id)
        erasures = self.store._state.erasures
        erasures[key] = replace(erasures[key], erased_at=AT)
        return AT

    async def remove_deleted_leftovers(
        self, tenant_id: str, document_id: uuid.UUID, *, batch_rows: int
    ) -> Mapping[str, int]:
        return {}  # the memory store keeps no chunks, slices or served ACL to remove


async def _document(store: MemoryPublisherStore) -> uuid.UUID:
    store.add_tenant("acme", "standard", b"\x00" * 32)
    publisher = Publisher(store, max_upload_bytes=1024)
    created = await publisher.create_document("acme", "Refunds", Upload(b"v1", "text/plain", None))
    return created.document_id


async def test_erase_deletes_once_and_erases_once() -> None:
    store = MemoryPublisherStore()
    document_id = await _document(store)
    erasure = CountingErasure(store)
    publisher = Publisher(store, max_upload_bytes=1024, erasure=erasure)
    first = await publisher.erase_document("acme", document_id, ErasureRequest("cli"), now=AT)
    again = await publisher.erase_document("acme", document_id, ErasureRequest("cli"))
    assert first.changed
    assert not again.changed
    assert erasure.runs == 1
    assert (again.erased_at, again.requested_at) == (first.erased_at, first.requested_at)
    assert [e.event_type for e in store.events()] == ["DocumentDeleted"]
    status = await publisher.document_status("acme", document_id)
    assert status.deleted_at == AT


async def test_a_publisher_without_an_erasure_store_refuses_and_deletes_nothing() -> None:
    store = MemoryPublisherStore()
    document_id = await _document(store)
    publisher = Publisher(store, max_upload_bytes=1024)
    with pytest.raises(EraseUnavailable) as refused:
        await publisher.erase_document("acme", document_id, ErasureRequest("cli"))
    assert refused.value.code == "ERASE_UNAVAILABLE"
    assert store.events() == []
    assert (await publisher.document_status("acme", document_id)).deleted_at is None
