"""Backfill publishing: many documents (or new versions) uploaded and published in one call.

Each item is still what the single calls make of it: its own version, ACL, index task and
outbox events, checked by the same rules. An item that breaks a rule is refused on its own,
with the problem code the single call would answer; the others go on.

New documents -- a backfill's bulk -- are written together: one transaction, one statement
per table for all of them (``BulkStore.insert_published_documents``). Nothing else can write
a document that does not exist yet, so this is the single calls' outcome without their
per-document round trips. A new version of an existing document is what the single calls
``add_version`` then ``publish`` make, in one transaction (``Publisher.add_and_publish``):
its document is locked as for any publish, and an item refused leaves nothing behind (no
DRAFT version). A delete or an erase item is the single call's, in its own transactions.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Protocol

from services.publisher.domain import (
    Publication,
    Publisher,
    Upload,
    check_principals,
    check_title,
    check_upload_off_loop,
    publication_events,
)
from services.publisher.ports import ErasureRequest, LockedDocument, PendingEvent, VersionInfo
from services.runtime.errors import KbError
from services.runtime.messaging.avro import SchemaRegistry, default_registry
from services.runtime.tracing.propagation import traceparent_of
from services.runtime.tracing.spans import (
    TENANT_ID,
    document_attributes,
    link_here,
    mark_failed,
    span_under,
    start_span,
)

# A new document published at once: created at revision 1, published at revision 2.
PUBLISHED_REVISION = 2


@dataclass(frozen=True)
class BulkItem:
    """One item of a bulk call: a new document (``title``) or a new version of an existing
    one (``document_id``), with the read ACL it is published with; or the delete of
    ``document_id`` at ``delete_revision``, or its erase (``erase``); those take no upload."""

    upload: Upload | None
    read_principals: list[str]
    title: str | None = None
    document_id: uuid.UUID | None = None
    delete_revision: int | None = None
    erase: bool = False


@dataclass(frozen=True)
class ItemPublished:
    index: int
    document_id: uuid.UUID
    version_number: int
    revision: int
    index_task_id: uuid.UUID


@dataclass(frozen=True)
class ItemDeleted:
    index: int
    document_id: uuid.UUID
    revision: int
    deleted_at: datetime


@dataclass(frozen=True)
class ItemErased:
    index: int
    document_id: uuid.UUID
    deleted_at: datetime
    requested_at: datetime
    erased_at: datetime


@dataclass(frozen=True)
class ItemRefused:
    index: int
    error: KbError


ItemResult = ItemPublished | ItemDeleted | ItemErased | ItemRefused


@dataclass(frozen=True)
class NewPublishedDocument:
    """A new document's rows as one bulk write stores them: version 1, published."""

    document_id: uuid.UUID
    title: str
    content: bytes
    media_type: str
    sha256: bytes
    read_principals: frozenset[str]
    index_task_id: uuid.UUID
    # Its own trace, linked to the bulk request's span (docs/operations.md#tracing).
    traceparent: str | None = None


class BulkStore(Protocol):
    async def tenant_tier(self, tenant_id: str) -> str: ...

    async def insert_published_documents(
        self,
        tenant_id: str,
        tier: str,
        documents: Sequence[NewPublishedDocument],
        events: Sequence[PendingEvent],
        now: datetime | None,
    ) -> None:
        """Every document with its version, ACL, PENDING task and events, in one
        transaction: all of them or none."""
        ...


class BulkPublisher:
    def __init__(
        self,
        publisher: Publisher,
        store: BulkStore,
        *,
        max_upload_bytes: int,
        registry: SchemaRegistry | None = None,
    ) -> None:
        self._publisher = publisher
        self._store = store
        self._max_upload_bytes = max_upload_bytes
        self._registry = registry or default_registry()

    async def publish_many(
        self,
        tenant_id: str,
        items: Sequence[BulkItem],
        *,
        eraser: ErasureRequest | KbError | None = None,
        now: datetime | None = None,
    ) -> list[ItemResult]:
        """One result per item, in order. ``eraser``: who asks for the erase items (an admin
        key), or why the caller may not (its error refuses each erase item alone, as the
        single call would answer it). One span for the request; each document's publish
        starts a trace of its own, linked to it: a document's path from publish to
        searchable is one trace, whatever request carried it."""
        with span_under("kb.publish.bulk", None, attributes={TENANT_ID: tenant_id}) as span:
            span.set_attribute("kb.bulk.items", len(items))
            return await self._publish_many(tenant_id, items, eraser, now)

    async def _publish_many(
        self,
        tenant_id: str,
        items: Sequence[BulkItem],
        eraser: ErasureRequest | KbError | None,
        now: datetime | None,
    ) -> list[ItemResult]:
        results: dict[int, ItemResult] = {}
        documents: list[tuple[int, NewPublishedDocument]] = []
        for index, item in enumerate(items):
            if item.document_id is not None:
                continue  # a new version or a delete: below, in order
            try:
                documents.append((index, await self._new_document(item)))
            except KbError as error:
                results[index] = ItemRefused(index, error)
        if documents:
            tier = await self._store.tenant_tier(tenant_id)
            spans = [
                start_span(
                    "kb.publish",
                    None,
                    root=True,
                    links=link_here(),
                    attributes=document_attributes(tenant_id, document.document_id, 1),
                )
                for _, document in documents
            ]
            documents = [
                (index, replace(document, traceparent=traceparent_of(span.get_span_context())))
                for (index, document), span in zip(documents, spans, strict=True)
            ]
            events = [
                event
                for _, document in documents
                for event in self._events(tenant_id, tier, document, now)
            ]
            try:
                await self._store.insert_published_documents(
                    tenant_id, tier, [document for _, document in documents], events, now
                )
            except BaseException as error:
                for span in spans:
                    mark_failed(span, error)
                raise
            finally:
                for span in spans:
                    span.end()
            for index, document in documents:
                results[index] = ItemPublished(
                    index, document.document_id, 1, PUBLISHED_REVISION, document.index_task_id
                )
        for index, item in enumerate(items):
            # An item on an existing document runs as its single call does, in that call's
            # own transaction(s): refused alone.
            try:
                if item.erase:
                    results[index] = await self._erase(index, tenant_id, item, eraser, now)
                elif item.delete_revision is not None:
                    results[index] = await self._delete(index, tenant_id, item, now)
                elif item.document_id is not None:
                    results[index] = await self._new_version(index, tenant_id, item, now)
            except KbError as error:
                results[index] = ItemRefused(index, error)
        return [results[index] for index in range(len(items))]

    async def _delete(
        self, index: int, tenant_id: str, item: BulkItem, now: datetime | None
    ) -> ItemResult:
        """What the single DELETE does."""
        assert item.document_id is not None
        assert item.delete_revision is not None
        deleted = await self._publisher.delete_document(
            tenant_id, item.document_id, expected_revision=item.delete_revision, now=now
        )
        return ItemDeleted(index, item.document_id, deleted.revision, deleted.deleted_at)

    async def _erase(
        self,
        index: int,
        tenant_id: str,
        item: BulkItem,
        eraser: ErasureRequest | KbError | None,
        now: datetime | None,
    ) -> ItemResult:
        """What the single erase does (its transaction, then its batches)."""
        assert item.document_id is not None
        if eraser is None:
            raise AssertionError("an erase item without an eraser")  # the route passes one
        if isinstance(eraser, KbError):
            return ItemRefused(index, eraser)
        erased = await self._publisher.erase_document(tenant_id, item.document_id, eraser, now=now)
        return ItemErased(
            index, item.document_id, erased.deleted_at, erased.requested_at, erased.erased_at
        )

    async def _new_document(self, item: BulkItem) -> NewPublishedDocument:
        assert item.upload is not None
        title = check_title(item.title or "")
        media_type = await check_upload_off_loop(item.upload, self._max_upload_bytes)
        principals = check_principals(item.read_principals)
        return new_published_document(title, item.upload.content, media_type, principals)

    async def _new_version(
        self, index: int, tenant_id: str, item: BulkItem, now: datetime | None
    ) -> ItemResult:
        """What the single upload and publish of a version do."""
        assert item.document_id is not None
        assert item.upload is not None
        with span_under(
            "kb.publish.bulk_item",
            None,
            root=True,
            links=link_here(),
            attributes=document_attributes(tenant_id, item.document_id),
        ):
            published = await self._publisher.add_and_publish(
                tenant_id,
                item.document_id,
                item.upload,
                read_principals=item.read_principals,
                now=now,
            )
        return ItemPublished(
            index,
            item.document_id,
            published.version_number,
            published.revision,
            published.index_task_id,
        )

    def _events(
        self, tenant_id: str, tier: str, document: NewPublishedDocument, now: datetime | None
    ) -> list[PendingEvent]:
        return new_document_events(self._registry, tenant_id, tier, document, now)


def new_published_document(
    title: str,
    content: bytes,
    media_type: str,
    principals: frozenset[str],
    traceparent: str | None = None,
) -> NewPublishedDocument:
    """A new document's rows, its ids made here (everything given checked by the caller)."""
    return NewPublishedDocument(
        document_id=uuid.uuid4(),
        title=title,
        content=content,
        media_type=media_type,
        sha256=hashlib.sha256(content).digest(),
        read_principals=principals,
        index_task_id=uuid.uuid4(),
        traceparent=traceparent,
    )


def new_document_events(
    registry: SchemaRegistry,
    tenant_id: str,
    tier: str,
    document: NewPublishedDocument,
    now: datetime | None,
    command_id: uuid.UUID | None = None,
) -> list[PendingEvent]:
    """The events the single calls would add for this document: its task created, its
    version published (revision 2, nothing published before); ``command_id``: the ingest
    command that published it."""
    # The document and its version 1 as the single calls' publish would find them:
    # created at revision 1, nothing published yet.
    created = LockedDocument(tenant_id, document.document_id, tier, document.title, 1, 1, None)
    version = VersionInfo(1, "DRAFT", document.media_type, document.sha256, len(document.content))
    publication = Publication(
        created,
        version,
        PUBLISHED_REVISION,
        document.read_principals,
        document.index_task_id,
        now or datetime.now(UTC),
        command_id,
    )
    return [
        replace(event, traceparent=document.traceparent)
        for event in publication_events(registry, publication, task_created=True)
    ]
