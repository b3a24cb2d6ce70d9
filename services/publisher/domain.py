"""Publisher domain: uploads, the one-transaction publish, and what a document's status is.

No driver here: storage is reached through :mod:`services.publisher.ports`, events are
encoded with the Avro registry (pure code) and handed to the transaction's outbox port.
"""

from __future__ import annotations

import enum
import hashlib
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

from services.publisher.failures import tenant_failure_message
from services.publisher.ports import (
    PRIMARY,
    DocumentDeletion,
    DocumentHeader,
    DocumentStatusRecord,
    ErasureRequest,
    ErasureStore,
    LockedDocument,
    NewVersion,
    PendingEvent,
    PublisherStore,
    PublishTransaction,
    VersionInfo,
)
from services.publisher.text import clean_text, nfc
from services.runtime.errors import (
    BadInput,
    Conflict,
    KbError,
    NotFound,
    PayloadTooLarge,
    UnsupportedMediaType,
)
from services.runtime.indexing.media_types import (
    SUPPORTED_MEDIA_TYPES,
    check_content,
    declared_charset,
    normalise_media_type,
    run_media_check,
)
from services.runtime.indexing.tasks import (
    TASK_TYPE_INDEX_VERSION,
    IndexTaskRecord,
    NewIndexTask,
    TaskProgress,
    TaskStatus,
)
from services.runtime.logging import get_logger
from services.runtime.messaging.avro import SchemaRegistry, default_registry
from services.runtime.messaging.events import (
    DOCUMENT_DELETED,
    DOCUMENT_VERSION_PUBLISHED,
    INDEX_TASK_CREATED,
    event_id,
)
from services.runtime.pg.records import copied
from services.runtime.tenancy.principals import normalise_principal
from services.runtime.tracing.spans import (
    VERSION_NUMBER,
    annotate,
    document_attributes,
    span_under,
)

MAX_TITLE_LENGTH: Final = 500
MAX_PRINCIPAL_LENGTH: Final = 200

log = get_logger(__name__)


class RevisionConflict(Conflict):
    """The client's revision is not the document's: someone changed it in between."""

    code = "REVISION_CONFLICT"

    def __init__(self, expected: int, current: int) -> None:
        super().__init__(
            f"the document is at revision {current}, not {expected}; "
            "read it again and retry with the current revision"
        )
        self.current_revision = current

    @property
    def problem_fields(self) -> dict[str, Any]:
        return {"currentRevision": self.current_revision}


def document_not_found(document_id: uuid.UUID) -> NotFound:
    return NotFound(f"no document {document_id} in this tenant", code="DOCUMENT_NOT_FOUND")


def version_not_found(document_id: uuid.UUID, version_number: int) -> NotFound:
    return NotFound(
        f"document {document_id} has no version {version_number}", code="VERSION_NOT_FOUND"
    )


def document_deleted(document_id: uuid.UUID) -> Conflict:
    """A change to a deleted document: a delete is final (docs/architecture.md#document-
    lifecycle); publish the content again as a new document."""
    return Conflict(
        f"document {document_id} was deleted; a deleted document takes no new version or "
        "publish: upload the content as a new document",
        code="DOCUMENT_DELETED",
    )


def index_task_not_found(task_id: uuid.UUID) -> NotFound:
    return NotFound(f"no index task {task_id} in this tenant", code="INDEX_TASK_NOT_FOUND")


class IndexStatus(enum.StrEnum):
    NOT_PUBLISHED = "NOT_PUBLISHED"
    INDEXING = "INDEXING"
    SEARCHABLE = "SEARCHABLE"
    FAILED = "FAILED"
    DELETED = "DELETED"


# --- uploads ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Upload:
    content: bytes
    declared_media_type: str | None
    filename: str | None


def resolve_media_type(declared: str | None, filename: str | None) -> str:
    """The media type the indexer will parse the file as, or 415."""
    media_type = normalise_media_type(declared, filename)
    if media_type not in SUPPORTED_MEDIA_TYPES:
        accepted = ", ".join(sorted(SUPPORTED_MEDIA_TYPES))
        raise UnsupportedMediaType(
            f"media type {media_type or 'none'!r} cannot be indexed; accepted: {accepted}"
        )
    return media_type


def check_upload(upload: Upload, max_upload_bytes: int) -> str:
    """Validate an upload; its media type (the declared one, checked against the bytes)."""
    if not upload.content:
        raise BadInput("the file is empty", code="EMPTY_FILE")
    if len(upload.content) > max_upload_bytes:
        raise PayloadTooLarge(
            f"the file has {len(upload.content)} bytes; the limit is {max_upload_bytes}"
        )
    media_type = resolve_media_type(upload.declared_media_type, upload.filename)
    # The bytes must be what the type says (415 MEDIA_TYPE_MISMATCH otherwise): a file is
    # stored, served and parsed as its declared type, never as something it only claims.
    check_content(media_type, upload.content, charset=declared_charset(upload.declared_media_type))
    return media_type


async def check_upload_off_loop(upload: Upload, max_upload_bytes: int) -> str:
    """``check_upload`` in a worker thread: decoding a large text (or refusing a hostile
    one) must not hold the event loop that serves every tenant's requests."""
    return await run_media_check(check_upload, upload, max_upload_bytes)


def check_title(title: str) -> str:
    """The title as stored: NFC, trimmed; 422 when blank, too long or holding a character
    that hides or reorders text (``services.runtime.tenancy.hidden_characters``: controls,
    format characters, bidi marks, line and paragraph separators, surrogates,
    noncharacters, every default-ignorable code point, U+2800)."""
    return clean_text(title, what="title", max_length=MAX_TITLE_LENGTH, code="TITLE_INVALID")


def check_principals(principals: list[str]) -> frozenset[str]:
    """The principals as stored and compared (``normalise_principal``: NFC, trimmed),
    without duplicates; 422 for a blank, too long or invisible-character principal."""
    return frozenset(
        normalise_principal(
            clean_text(
                p, what="principal", max_length=MAX_PRINCIPAL_LENGTH, code="PRINCIPAL_INVALID"
            )
        )
        for p in principals
    )


@dataclass(frozen=True)
class VersionCreated:
    document_id: uuid.UUID
    version_number: int
    revision: int


@dataclass(frozen=True)
class PublishOutcome:
    document_id: uuid.UUID
    version_number: int
    revision: int
    index_task_id: uuid.UUID
    # False when the request changed nothing (a retry of a publish that already happened).
    changed: bool


@dataclass(frozen=True)
class DeleteOutcome:
    document_id: uuid.UUID
    revision: int  # the revision the delete committed
    deleted_at: datetime
    # A WAL position past the delete's commit: a search naming it in `after` never returns
    # the document, on any server (docs/scaling.md#read-your-switch).
    search_token: str
    # False when the document was deleted already (a retry): nothing was written.
    changed: bool


@dataclass(frozen=True)
class EraseOutcome:
    document_id: uuid.UUID
    deleted_at: datetime
    requested_at: datetime  # when the erase was first asked for (the audit row's)
    erased_at: datetime
    # A WAL position past the erase's commits: a search naming it in `after` never returns
    # the document, on any server.
    search_token: str
    # False when the document was erased already (a repeat): nothing was written.
    changed: bool


class EraseUnavailable(KbError, code="ERASE_UNAVAILABLE"):
    """A publisher built without an erasure store was asked to erase (a wiring bug: 500)."""


def _occurred_at(now: datetime | None) -> datetime:
    return now if now is not None else datetime.now(UTC)


# --- status --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Failure:
    error_code: str
    message: str | None
    attempts: int
    failed_at: datetime | None


@dataclass(frozen=True)
class DocumentStatus(DocumentHeader):
    index_status: IndexStatus
    index_task_id: uuid.UUID | None
    failure: Failure | None
    # When the published version became published while search still serves another one:
    # how long the search version has been lagging. None when it does not lag.
    search_lag_since: datetime | None
    # A search naming it in `after` sees search_version or a later one, on any replica.
    search_token: str | None = None
    read_from: str = PRIMARY  # the server that answered (a replica's name, or PRIMARY)
    erased_at: datetime | None = None  # when its erase finished (status stays DELETED)


@dataclass(frozen=True)
class TenantTaskKey:
    """What a task is of, as its tenant names it (the tenant is the caller)."""

    task_id: uuid.UUID
    document_id: uuid.UUID
    version_number: int
    task_type: str
    tier: str


@dataclass(frozen=True)
class TenantTaskView(TaskProgress, TenantTaskKey):
    """An index task as its tenant sees it: the state and a stable code with a fixed
    message. Not the lease owner (host:pid) nor the stored error text: operators read those
    with `kb tasks show` and in the logs."""


def tenant_task_view(task: IndexTaskRecord) -> TenantTaskView:
    """The task's fields a tenant sees, the stored error text replaced by the code's."""
    return copied(TenantTaskView, task, error_message=tenant_failure_message(task.error_code))


def derive_status(record: DocumentStatusRecord) -> DocumentStatus:
    task = record.task
    failure: Failure | None = None
    lag_since: datetime | None = None
    served: dict[str, Any] = {}
    if record.deleted_at is not None:
        # Nothing of it is served (its pointer is a tombstone: its version serves no chunk),
        # whatever its tasks did. The search token stays: it is past the delete's commit.
        status = IndexStatus.DELETED
        task = None
        served = {"search_version": None, "search_switched_at": None}
    elif record.published_version is None:
        status = IndexStatus.NOT_PUBLISHED
    elif record.search_version == record.published_version:
        status = IndexStatus.SEARCHABLE
    else:
        lag_since = record.published_at
        if task is not None and task.status is TaskStatus.DEAD:
            status = IndexStatus.FAILED
            failure = Failure(
                error_code=task.error_code or "UNKNOWN",
                message=tenant_failure_message(task.error_code),
                attempts=task.attempts,
                failed_at=task.finished_at or task.updated_at,
            )
        else:
            status = IndexStatus.INDEXING
    return copied(
        DocumentStatus,
        record,
        index_status=status,
        index_task_id=task.task_id if task is not None else None,
        failure=failure,
        search_lag_since=lag_since,
        **served,
    )


# --- events ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Publication:
    """What the events of one publish tell: the document as the publish found it, the
    version published with its ACL, the document's new revision, the version's index task."""

    document: LockedDocument
    version: VersionInfo
    revision: int
    read_principals: frozenset[str]
    task_id: uuid.UUID
    occurred_at: datetime
    # The ingest command the publish follows from (docs/architecture.md#publish-by-event).
    command_id: uuid.UUID | None = None


def publication_events(
    registry: SchemaRegistry, publication: Publication, task_created: bool
) -> list[PendingEvent]:
    """The outbox events of a publish: the index task's creation (when this publish created
    it), then the version's publication -- one per revision: a retried transaction writes
    the same ids."""
    p, document, version = publication, publication.document, publication.version
    events = []
    if task_created:
        events.append(
            _event(
                registry,
                INDEX_TASK_CREATED,
                event_id(INDEX_TASK_CREATED, p.task_id),
                p,
                {"taskId": p.task_id, "taskType": TASK_TYPE_INDEX_VERSION},
            )
        )
    published = {
        "revision": p.revision,
        "previousPublishedVersion": document.published_version,
        "title": document.title,
        "mediaType": version.media_type,
        "sha256": version.sha256.hex(),
        "sizeBytes": version.size_bytes,
        "readPrincipals": sorted(p.read_principals),
        "indexTaskId": p.task_id,
        "commandId": p.command_id,
    }
    id_ = event_id(DOCUMENT_VERSION_PUBLISHED, document.tenant_id, document.document_id, p.revision)
    events.append(_event(registry, DOCUMENT_VERSION_PUBLISHED, id_, p, published))
    return events


def _event(
    registry: SchemaRegistry,
    event_type: str,
    id_: uuid.UUID,
    p: Publication,
    fields: dict[str, Any],
) -> PendingEvent:
    document = p.document
    record = {
        "eventId": id_,
        "tenantId": document.tenant_id,
        "tier": document.tier,
        "documentId": document.document_id,
        "versionNumber": p.version.version_number,
        **fields,
        "occurredAt": p.occurred_at,
    }
    payload = registry.encode(event_type, record)
    return PendingEvent(
        id_, event_type, document.tenant_id, document.tier, document.document_id, payload
    )


def deletion_event(
    registry: SchemaRegistry,
    document: LockedDocument,
    deletion: DocumentDeletion,
    occurred_at: datetime,
    command_id: uuid.UUID | None = None,
) -> PendingEvent:
    """The delete's outbox event: ids and numbers, never content or a title (an event stays
    in Kafka until the topic's retention, whatever is erased later). One per document: a
    document is deleted once, and a retried transaction writes the same id."""
    id_ = event_id(DOCUMENT_DELETED, document.tenant_id, document.document_id)
    record = {
        "eventId": id_,
        "tenantId": document.tenant_id,
        "tier": document.tier,
        "documentId": document.document_id,
        "versionNumber": document.latest_version,
        "revision": deletion.revision,
        "previousSearchVersion": deletion.previous_search_version,
        "cancelledTasks": deletion.cancelled_tasks,
        "commandId": command_id,
        "occurredAt": occurred_at,
    }
    payload = registry.encode(DOCUMENT_DELETED, record)
    return PendingEvent(
        id_, DOCUMENT_DELETED, document.tenant_id, document.tier, document.document_id, payload
    )


# --- the service ---------------------------------------------------------------------------


class Publisher:
    def __init__(
        self,
        store: PublisherStore,
        *,
        max_upload_bytes: int,
        registry: SchemaRegistry | None = None,
        erasure: ErasureStore | None = None,
        erase_batch_rows: int = 1000,
    ) -> None:
        self._store = store
        # The erase's batches (services/runtime/erasure/erase_pg.py); None: erase is not served.
        self._erasure = erasure
        self._erase_batch_rows = erase_batch_rows
        self._max_upload_bytes = max_upload_bytes
        self._registry = registry or default_registry()

    async def create_document(
        self, tenant_id: str, title: str, upload: Upload, *, now: datetime | None = None
    ) -> VersionCreated:
        clean_title = check_title(title)
        media_type = await check_upload_off_loop(upload, self._max_upload_bytes)
        document_id = uuid.uuid4()
        async with self._store.transaction(tenant_id) as tx:
            return await create_in(
                tx, tenant_id, document_id, clean_title, upload.content, media_type, now
            )

    async def add_version(
        self,
        tenant_id: str,
        document_id: uuid.UUID,
        upload: Upload,
        *,
        now: datetime | None = None,
    ) -> VersionCreated:
        media_type = await check_upload_off_loop(upload, self._max_upload_bytes)
        async with self._store.transaction(tenant_id) as tx:
            return await add_version_in(tx, tenant_id, document_id, upload.content, media_type, now)

    async def add_and_publish(
        self,
        tenant_id: str,
        document_id: uuid.UUID,
        upload: Upload,
        *,
        read_principals: list[str],
        now: datetime | None = None,
    ) -> PublishOutcome:
        """``add_version`` then ``publish`` of that version, in one transaction: the version
        is published, or nothing is left (no DRAFT behind a refusal). The document stays
        locked from one to the other, so no other publish can come between them."""
        principals = check_principals(read_principals)
        media_type = await check_upload_off_loop(upload, self._max_upload_bytes)
        with span_under("kb.publish", None, attributes=document_attributes(tenant_id, document_id)):
            async with self._store.transaction(tenant_id) as tx:
                created = await add_version_in(
                    tx, tenant_id, document_id, upload.content, media_type, now
                )
                return await self.publish_in(
                    tx,
                    tenant_id,
                    document_id,
                    created.version_number,
                    created.revision,
                    principals,
                    now,
                )

    async def publish(
        self,
        tenant_id: str,
        document_id: uuid.UUID,
        version_number: int,
        *,
        expected_revision: int,
        read_principals: list[str],
        now: datetime | None = None,
    ) -> PublishOutcome:
        """Publish ``version_number`` with its READ ACL, in one transaction.

        The ACL is the version's: search applies it once the version is the one it serves
        (a wider ACL never opens the version still served), and at once for the version
        already served (``replace_acl``).

        The document row is locked first (``FOR NO KEY UPDATE``): concurrent publishes of one
        document run one after the other, so the second sees the first one's revision and
        gets a 409. A request that would change nothing (this version is already the
        published one, with this very ACL) is a retry: it answers the same task, bumps no
        revision and adds no event.
        """
        principals = check_principals(read_principals)
        # The span is current in the transaction: the task and outbox rows store it
        # (docs/operations.md#tracing).
        with span_under("kb.publish", None, attributes=document_attributes(tenant_id, document_id)):
            async with self._store.transaction(tenant_id) as tx:
                return await self.publish_in(
                    tx, tenant_id, document_id, version_number, expected_revision, principals, now
                )

    async def publish_in(
        self,
        tx: PublishTransaction,
        tenant_id: str,
        document_id: uuid.UUID,
        version_number: int,
        expected_revision: int | None,
        principals: frozenset[str],
        now: datetime | None,
        command_id: uuid.UUID | None = None,
    ) -> PublishOutcome:
        """``publish``'s work inside ``tx`` (the ingest consumer's too: its command is
        recorded in the same transaction). ``expected_revision`` None: no revision check
        (an ingest command of a document applies in its topic order)."""
        document = await _lock_live_document(tx, tenant_id, document_id)
        version = await tx.get_version(tenant_id, document_id, version_number)
        if version is None:
            raise version_not_found(document_id, version_number)
        annotate({VERSION_NUMBER: version_number})
        # The version's ACL, compared as stored now: NFC (rows written before NFC
        # normalisation included). An ACL-only change re-publishes the version.
        current_acl = frozenset(
            nfc(p) for p in await tx.read_acl(tenant_id, document_id, version_number)
        )
        if document.published_version == version_number and current_acl == principals:
            existing = await tx.find_index_task(
                tenant_id, document_id, version_number, TASK_TYPE_INDEX_VERSION
            )
            if existing is not None:
                return PublishOutcome(
                    document_id, version_number, document.revision, existing, changed=False
                )
        if expected_revision is not None and expected_revision != document.revision:
            raise RevisionConflict(expected_revision, document.revision)
        if document.published_version is not None and version_number < (document.published_version):
            # Search only ever moves forward: an older version would never be served.
            raise Conflict(
                f"version {version_number} is older than the published version "
                f"{document.published_version}; upload it again as a new version",
                code="VERSION_SUPERSEDED",
            )
        revision = await tx.publish_version(tenant_id, document_id, version_number, now)
        task = await tx.ensure_index_task(
            NewIndexTask(
                task_id=uuid.uuid4(),
                tenant_id=tenant_id,
                document_id=document_id,
                version_number=version_number,
                task_type=TASK_TYPE_INDEX_VERSION,
                tier=document.tier,
            ),
            now,
        )
        # The version's ACL: search applies it when the version becomes the served one
        # (the pointer's switch), at once when it is already served (issue 29, item 1).
        # After the task: a completion holds its task row before the pointer row, and the
        # task's insert waits for a completion updating it, so the pointer row is taken
        # last (services/publisher/queries.sql: lock_search_pointer gives the order).
        await tx.replace_acl(tenant_id, document_id, version_number, principals)
        publication = Publication(
            document, version, revision, principals, task.task_id, _occurred_at(now), command_id
        )
        for event in publication_events(self._registry, publication, task.created):
            await tx.add_event(event)
        return PublishOutcome(document_id, version_number, revision, task.task_id, changed=True)

    async def delete_document(
        self,
        tenant_id: str,
        document_id: uuid.UUID,
        *,
        expected_revision: int,
        now: datetime | None = None,
    ) -> DeleteOutcome:
        """Delete the document, in one transaction (docs/architecture.md#document-lifecycle):
        it leaves search (its pointer moves forward to a tombstone), its served ACL goes,
        its unfinished index tasks end (DEAD, DOCUMENT_DELETED) and a DocumentDeleted event
        is added. The document row is locked first, as by a publish: a publish and a delete
        of one document run one after the other, and the second sees the first's revision.

        A document deleted already answers what its delete did, whatever the revision (a
        retry after a lost answer carries the revision the delete bumped), and writes
        nothing. After the commit its chunks and staged slices are removed in batches (with
        an erasure store wired). The search token is read after the commit, so it covers
        it."""
        async with self._store.transaction(tenant_id) as tx:
            revision, deleted_at, changed = await self.delete_in(
                tx, tenant_id, document_id, expected_revision, now
            )
        if changed:
            await self.remove_leftovers(tenant_id, document_id)
        token = await self._store.primary_search_token()
        return DeleteOutcome(document_id, revision, deleted_at, token, changed)

    async def remove_leftovers(self, tenant_id: str, document_id: uuid.UUID) -> None:
        """A deleted document's chunks serve nothing any more (the tombstone matches none,
        for good): they go after the delete's commit, in the erase's bounded batches, which
        hold no lock a publish or a search waits for. The delete is done whatever happens
        here: a failure (or a crash) leaves them to `kb index check --repair`
        (DELETED_CHUNKS) rather than fail an answer whose delete committed. The versions
        stay, for the erase. Without an erasure store wired, nothing is removed here.
        Run after the commit of any delete (``delete_in`` inside another transaction)."""
        if self._erasure is None:
            return
        try:
            await self._erasure.remove_deleted_leftovers(
                tenant_id, document_id, batch_rows=self._erase_batch_rows
            )
        except KbError as error:
            log.warning(
                "document.delete_leftovers_kept",
                tenant_id=tenant_id,
                document_id=str(document_id),
                error_code=error.code,
            )

    async def delete_in(
        self,
        tx: PublishTransaction,
        tenant_id: str,
        document_id: uuid.UUID,
        expected_revision: int | None,
        now: datetime | None,
        command_id: uuid.UUID | None = None,
    ) -> tuple[int, datetime, bool]:
        """``delete_document``'s work inside ``tx``: the revision the delete committed,
        when, and whether this call wrote it. ``expected_revision`` None: no check."""
        document = await _lock_document(tx, tenant_id, document_id)
        if document.deleted_at is not None:
            return document.revision, document.deleted_at, False
        if expected_revision is not None and expected_revision != document.revision:
            raise RevisionConflict(expected_revision, document.revision)
        deletion = await tx.delete_document(document, now)
        await tx.add_event(
            deletion_event(self._registry, document, deletion, _occurred_at(now), command_id)
        )
        return deletion.revision, deletion.deleted_at, True

    async def erase_document(
        self,
        tenant_id: str,
        document_id: uuid.UUID,
        request: ErasureRequest,
        *,
        now: datetime | None = None,
        command_id: uuid.UUID | None = None,
    ) -> EraseOutcome:
        """Erase the document's content (docs/architecture.md#document-lifecycle). Erase
        implies delete: one transaction deletes a live document (as ``delete_document``
        does, whatever its revision: an erase is an admin's order, not an edit) and writes
        the audit row in progress; then the erasure store removes the content in bounded
        batches, each its own short transaction, and sets ``erased_at``. Erasing an erased
        document writes nothing and answers what its erase did; one left in progress (a
        crash) is finished."""
        if self._erasure is None:
            raise EraseUnavailable("this publisher has no erasure store wired")
        async with self._store.transaction(tenant_id) as tx:
            document = await _lock_document(tx, tenant_id, document_id)
            deleted_at = document.deleted_at
            if deleted_at is None:
                deletion = await tx.delete_document(document, now)
                await tx.add_event(
                    deletion_event(
                        self._registry, document, deletion, _occurred_at(now), command_id
                    )
                )
                deleted_at = deletion.deleted_at
            record = await tx.start_erasure(tenant_id, document_id, request, now)
        erased_at, changed = record.erased_at, False
        if erased_at is None:
            erased_at = await self._erasure.erase_content(
                tenant_id, document_id, batch_rows=self._erase_batch_rows, now=now
            )
            changed = True
        token = await self._store.primary_search_token()
        return EraseOutcome(document_id, deleted_at, record.requested_at, erased_at, token, changed)

    async def document_status(self, tenant_id: str, document_id: uuid.UUID) -> DocumentStatus:
        record = await self._store.document_status(tenant_id, document_id)
        if record is None:
            raise document_not_found(document_id)
        return derive_status(record)

    async def index_task(self, tenant_id: str, task_id: uuid.UUID) -> TenantTaskView:
        task = await self._store.index_task(tenant_id, task_id)
        if task is None:
            raise index_task_not_found(task_id)
        return tenant_task_view(task)


async def _lock_document(
    tx: PublishTransaction, tenant_id: str, document_id: uuid.UUID
) -> LockedDocument:
    """The document's row, locked for the transaction (one change of a document at a time)."""
    document = await tx.lock_document(tenant_id, document_id)
    if document is None:
        raise document_not_found(document_id)
    return document


async def _lock_live_document(
    tx: PublishTransaction, tenant_id: str, document_id: uuid.UUID
) -> LockedDocument:
    """The document's row, locked; a deleted document takes no new version nor publish."""
    document = await _lock_document(tx, tenant_id, document_id)
    if document.deleted_at is not None:
        raise document_deleted(document_id)
    return document


async def create_in(
    tx: PublishTransaction,
    tenant_id: str,
    document_id: uuid.UUID,
    title: str,
    content: bytes,
    media_type: str,
    now: datetime | None,
) -> VersionCreated:
    """``create_document``'s work inside ``tx``: the document and its version 1, a DRAFT
    (``title`` checked by the caller)."""
    await tx.insert_document(tenant_id, document_id, title, now)
    await tx.insert_version(_new_version(tenant_id, document_id, 1, content, media_type), now)
    return VersionCreated(document_id=document_id, version_number=1, revision=1)


async def add_version_in(
    tx: PublishTransaction,
    tenant_id: str,
    document_id: uuid.UUID,
    content: bytes,
    media_type: str,
    now: datetime | None,
) -> VersionCreated:
    """``add_version``'s work inside ``tx``: the next version, a DRAFT."""
    document = await _lock_live_document(tx, tenant_id, document_id)
    version_number = document.latest_version + 1
    await tx.insert_version(
        _new_version(tenant_id, document_id, version_number, content, media_type), now
    )
    revision = await tx.record_new_version(tenant_id, document_id, version_number, now)
    return VersionCreated(document_id, version_number, revision)


def _new_version(
    tenant_id: str, document_id: uuid.UUID, version_number: int, content: bytes, media_type: str
) -> NewVersion:
    return NewVersion(
        tenant_id=tenant_id,
        document_id=document_id,
        version_number=version_number,
        content=content,
        media_type=media_type,
        sha256=hashlib.sha256(content).digest(),
    )
