"""What the publisher needs from storage, as data-access methods behind Protocols.

One method per query, each taking plain values; the PostgreSQL adapter (``store_pg``) is the
real implementation. Every method that reads or writes tenant data takes the tenant id and
the adapter puts it in the WHERE clause: no query can wander into another tenant's rows.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final, Protocol

from services.runtime.auth.keys import TenantCredentials
from services.runtime.indexing.tasks import EnqueuedTask, IndexTaskRecord, NewIndexTask

# ``read_from`` of a status the primary answered.
PRIMARY: Final = "primary"


@dataclass(frozen=True)
class LockedDocument:
    """A document row, locked for the rest of the transaction (``FOR NO KEY UPDATE``)."""

    tenant_id: str
    document_id: uuid.UUID
    tier: str
    title: str
    revision: int
    latest_version: int
    published_version: int | None
    # When the document was deleted (None: it is not): every change but a repeated delete
    # is refused then.
    deleted_at: datetime | None = None


@dataclass(frozen=True)
class DocumentDeletion:
    """What a delete's transaction did: the revision it committed, when, the version search
    served until then (None: none) and the index tasks it ended."""

    revision: int
    deleted_at: datetime
    previous_search_version: int | None
    cancelled_tasks: int


@dataclass(frozen=True)
class VersionInfo:
    version_number: int
    status: str
    media_type: str
    sha256: bytes
    size_bytes: int


@dataclass(frozen=True)
class NewVersion:
    tenant_id: str
    document_id: uuid.UUID
    version_number: int
    content: bytes
    media_type: str
    sha256: bytes


@dataclass(frozen=True)
class PendingEvent:
    """An encoded event to add to the outbox in the current transaction."""

    event_id: uuid.UUID
    event_type: str
    tenant_id: str
    tier: str
    document_id: uuid.UUID  # the aggregate: its key is "<tenant>/<document>"
    payload: bytes
    # The trace its delivery continues; None: the transaction's current span
    # (services.runtime.messaging.outbox.traceparent_of_event).
    traceparent: str | None = None


@dataclass(frozen=True)
class DocumentHeader:
    """A document's versions, published and searched, as its status shows them."""

    document_id: uuid.UUID
    title: str
    revision: int
    latest_version: int
    published_version: int | None
    published_at: datetime | None
    search_version: int | None
    search_switched_at: datetime | None
    deleted_at: datetime | None


@dataclass(frozen=True)
class DocumentStatusRecord(DocumentHeader):
    task: IndexTaskRecord | None  # the published version's index task
    # A WAL position at or past the commit that made search_version searchable (None while
    # nothing is served): docs/scaling.md#read-your-switch.
    search_token: str | None = None
    # The server that answered: PRIMARY, or a read replica's name (docs/scaling.md).
    read_from: str = PRIMARY
    # When its erase finished (docs/architecture.md#document-lifecycle); None: not erased,
    # or its erase is still in progress.
    erased_at: datetime | None = None


@dataclass(frozen=True)
class ErasureRequest:
    """Who asked for an erase: an admin API key (``key_id``), or an operator's command
    (``requested_by`` "cli", no key)."""

    requested_by: str
    key_id: uuid.UUID | None = None


@dataclass(frozen=True)
class ErasureRecord:
    """The erase's audit row: when it was asked for and, once finished, when it was."""

    requested_at: datetime
    erased_at: datetime | None


class ErasureStore(Protocol):
    """The erase's content removal, in bounded batches of short transactions, as the tables'
    owner (it removes chunks, staged slices and rewrites outbox rows, which the API's tenant
    role may not write): services/runtime/erasure/erase_pg.py."""

    async def erase_content(
        self, tenant_id: str, document_id: uuid.UUID, *, batch_rows: int, now: datetime | None
    ) -> datetime:
        """Remove what is left of the document's content, batch by batch, each batch its own
        transaction; then set the audit row's ``erased_at`` and return it. Every step is
        idempotent: a run that stopped halfway is finished by the next."""
        ...

    async def remove_deleted_leftovers(
        self, tenant_id: str, document_id: uuid.UUID, *, batch_rows: int
    ) -> Mapping[str, int]:
        """What a deleted document may not keep (its chunks, staged slices, served ACL; a
        pointer that is not its tombstone), removed batch by batch, each batch its own
        transaction, fenced by the document's ``deleted_at``; rows per step."""
        ...


class StatusReplicas(Protocol):
    """Read replicas a document's status may be read on (docs/scaling.md#status-on-replicas):
    services/app.py passes search's replica rotation; the publisher never imports search."""

    def next_replica(self) -> tuple[str, Any] | None:
        """A replica in rotation, in turn, as its name and its pool (the adapter's: an
        asyncpg pool for store_pg); None while none is in rotation."""
        ...


class PublishTransaction(Protocol):
    async def lock_document(
        self, tenant_id: str, document_id: uuid.UUID
    ) -> LockedDocument | None: ...

    async def get_version(
        self, tenant_id: str, document_id: uuid.UUID, version_number: int
    ) -> VersionInfo | None: ...

    async def read_acl(
        self, tenant_id: str, document_id: uuid.UUID, version_number: int
    ) -> frozenset[str]:
        """The READ ACL the version was published with (empty: none, or not published)."""
        ...

    async def insert_document(
        self, tenant_id: str, document_id: uuid.UUID, title: str, now: datetime | None
    ) -> None: ...

    async def insert_version(self, version: NewVersion, now: datetime | None) -> None: ...

    async def record_new_version(
        self, tenant_id: str, document_id: uuid.UUID, version_number: int, now: datetime | None
    ) -> int:
        """Set the document's latest version, bump its revision; the new revision."""
        ...

    async def publish_version(
        self, tenant_id: str, document_id: uuid.UUID, version_number: int, now: datetime | None
    ) -> int:
        """Mark the version published and point the document at it, bump its revision; the
        new revision."""
        ...

    async def replace_acl(
        self,
        tenant_id: str,
        document_id: uuid.UUID,
        version_number: int,
        read_principals: frozenset[str],
    ) -> None:
        """Replace the version's READ ACL; search applies it when (or, for the version
        already served, as soon as) the version is the one it serves."""
        ...

    async def ensure_index_task(self, task: NewIndexTask, now: datetime | None) -> EnqueuedTask:
        """Create the task (of the tenant's serving generation) unless its business key
        exists; either way, its id. Also enqueues the version into each generation the
        tenant is built in beside the serving one (services.runtime.indexing.tasks:
        enqueue_generation_tasks), whose tasks the answer does not name."""
        ...

    async def find_index_task(
        self, tenant_id: str, document_id: uuid.UUID, version_number: int, task_type: str
    ) -> uuid.UUID | None: ...

    async def add_event(self, event: PendingEvent) -> None: ...

    async def delete_document(
        self, document: LockedDocument, now: datetime | None
    ) -> DocumentDeletion:
        """The delete's writes, ``document`` locked by this transaction and not deleted yet:
        its unfinished index tasks ended (DEAD, DOCUMENT_DELETED), its search pointer moved
        forward to a tombstone, its served ACL dropped, the document marked deleted with its
        revision bumped (docs/architecture.md#document-lifecycle). The caller adds the
        event."""
        ...

    async def start_erasure(
        self,
        tenant_id: str,
        document_id: uuid.UUID,
        request: ErasureRequest,
        now: datetime | None,
    ) -> ErasureRecord:
        """The erase's audit row, in progress, unless the document has one (a re-run): the
        row there is (docs/architecture.md#document-lifecycle)."""
        ...


class PublisherStore(TenantCredentials, Protocol):
    """The publisher's storage; it also answers the key checks of tenant authentication
    (``api_key``, ``verification_key``: services/runtime/auth/keys.py)."""

    def transaction(self, tenant_id: str) -> AbstractAsyncContextManager[PublishTransaction]:
        """A transaction of ``tenant_id``'s: it reads and writes only that tenant's rows
        (its statements name the tenant; the database's row security may hold them to it as
        well: services/runtime/tenancy/tenant_wall.py)."""
        ...

    async def document_status(
        self, tenant_id: str, document_id: uuid.UUID
    ) -> DocumentStatusRecord | None: ...

    async def index_task(self, tenant_id: str, task_id: uuid.UUID) -> IndexTaskRecord | None: ...

    async def primary_search_token(self) -> str:
        """A WAL position of the primary read now: called after a commit, it is past that
        commit, and a search naming it in ``after`` sees what the commit did."""
        ...

    async def readiness_problems(self) -> list[str]:
        """Why the service cannot serve now (empty when ready), for the operators' log."""
        ...
