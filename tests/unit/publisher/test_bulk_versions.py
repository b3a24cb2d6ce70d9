"""A bulk item that adds a version: its add and its publish are one transaction (issue 41)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from services.publisher.bulk.domain import BulkItem, BulkPublisher, ItemPublished, ItemRefused
from services.publisher.domain import Publisher, Upload
from services.publisher.ports import PendingEvent
from services.runtime.errors import DatabaseBusy
from tests.fakes.publisher_store import MemoryPublisherStore, MemoryPublishTransaction


class _NoBulkStore:
    """New versions only: the batch of new documents is never written."""

    async def tenant_tier(self, tenant_id: str) -> str:
        raise AssertionError("no new documents in this test")

    async def insert_published_documents(self, *args: Any, **kwargs: Any) -> None:
        raise AssertionError("no new documents in this test")


async def _published_document(store: MemoryPublisherStore, publisher: Publisher) -> uuid.UUID:
    created = await publisher.create_document("acme", "Doc", Upload(b"v1", "text/plain", None))
    await publisher.publish(
        "acme", created.document_id, 1, expected_revision=1, read_principals=["g"]
    )
    return created.document_id


def _item(document_id: uuid.UUID) -> BulkItem:
    return BulkItem(Upload(b"v2", "text/plain", None), ["g"], document_id=document_id)


@pytest.fixture
def store() -> MemoryPublisherStore:
    store = MemoryPublisherStore()
    store.add_tenant("acme", "standard", b"\x00" * 32)
    return store


async def test_a_publish_that_fails_leaves_no_draft_version(
    store: MemoryPublisherStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    publisher = Publisher(store, max_upload_bytes=1024)
    document_id = await _published_document(store, publisher)
    before = await store.document_status("acme", document_id)

    async def failing_add_event(self: MemoryPublishTransaction, event: PendingEvent) -> None:
        raise DatabaseBusy("the outbox insert was cancelled")

    monkeypatch.setattr(MemoryPublishTransaction, "add_event", failing_add_event)
    bulk = BulkPublisher(publisher, _NoBulkStore(), max_upload_bytes=1024)
    (result,) = await bulk.publish_many("acme", [_item(document_id)])

    assert isinstance(result, ItemRefused)
    assert result.error.code == "DATABASE_BUSY"
    assert await store.document_status("acme", document_id) == before


async def test_a_new_version_is_published_as_the_single_calls_publish_it(
    store: MemoryPublisherStore,
) -> None:
    publisher = Publisher(store, max_upload_bytes=1024)
    document_id = await _published_document(store, publisher)
    events_before = len(store.events())
    bulk = BulkPublisher(publisher, _NoBulkStore(), max_upload_bytes=1024)
    (result,) = await bulk.publish_many("acme", [_item(document_id)])

    assert isinstance(result, ItemPublished)
    # Created at revision 2 (v1 published), version 2 added at 3, published at 4.
    assert (result.version_number, result.revision) == (2, 4)
    status = await store.document_status("acme", document_id)
    assert status is not None
    assert (status.latest_version, status.published_version, status.revision) == (2, 2, 4)
    assert [e.event_type for e in store.events()[events_before:]] == [
        "IndexTaskCreated",
        "DocumentVersionPublished",
    ]
