"""An in-memory publisher store for unit tests.

It passes the same contract tests as the PostgreSQL adapter
(``tests/contract/test_publish_store_contract.py``). A transaction works on a copy of the
state under one lock and swaps it in only on success, so a failure anywhere inside leaves
nothing behind, and transactions run one at a time (coarser than PostgreSQL's row lock,
with the same outcome for the publisher's rules).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime

from services.publisher.ports import (
    DocumentDeletion,
    DocumentStatusRecord,
    ErasureRecord,
    ErasureRequest,
    LockedDocument,
    NewVersion,
    PendingEvent,
    VersionInfo,
)
from services.runtime.auth.keys import ApiKeyGrant, VerificationKey, admin_grant
from services.runtime.errors import Conflict
from services.runtime.indexing.tasks import (
    DEFAULT_MAX_ATTEMPTS,
    TASK_TYPE_INDEX_VERSION,
    EnqueuedTask,
    IndexTaskRecord,
    NewIndexTask,
    TaskStatus,
)

DocumentKey = tuple[str, uuid.UUID]


@dataclass
class _Document:
    title: str
    revision: int
    latest_version: int
    published_version: int | None = None
    published_at: datetime | None = None
    deleted_at: datetime | None = None


@dataclass
class _Version:
    content: bytes
    media_type: str
    sha256: bytes
    status: str = "DRAFT"
    published_at: datetime | None = None


@dataclass
class _State:
    tenants: dict[str, str] = field(default_factory=dict)  # tenant -> tier
    api_keys: set[tuple[str, bytes]] = field(default_factory=set)
    documents: dict[DocumentKey, _Document] = field(default_factory=dict)
    versions: dict[tuple[str, uuid.UUID, int], _Version] = field(default_factory=dict)
    # Each version's ACL, by (tenant, document, version).
    acl: dict[tuple[str, uuid.UUID, int], frozenset[str]] = field(default_factory=dict)
    tasks: dict[uuid.UUID, IndexTaskRecord] = field(default_factory=dict)
    search: dict[DocumentKey, tuple[int, datetime]] = field(default_factory=dict)
    outbox: list[PendingEvent] = field(default_factory=list)
    erasures: dict[DocumentKey, ErasureRecord] = field(default_factory=dict)


def _now(now: datetime | None) -> datetime:
    return now if now is not None else datetime.now(UTC)


class MemoryPublishTransaction:
    def __init__(self, state: _State) -> None:
        self._state = state

    async def lock_document(self, tenant_id: str, document_id: uuid.UUID) -> LockedDocument | None:
        doc = self._state.documents.get((tenant_id, document_id))
        if doc is None:
            return None
        return LockedDocument(
            tenant_id=tenant_id,
            document_id=document_id,
            tier=self._state.tenants[tenant_id],
            title=doc.title,
            revision=doc.revision,
            latest_version=doc.latest_version,
            published_version=doc.published_version,
            deleted_at=doc.deleted_at,
        )

    async def get_version(
        self, tenant_id: str, document_id: uuid.UUID, version_number: int
    ) -> VersionInfo | None:
        version = self._state.versions.get((tenant_id, document_id, version_number))
        if version is None:
            return None
        return VersionInfo(
            version_number=version_number,
            status=version.status,
            media_type=version.media_type,
            sha256=version.sha256,
            size_bytes=len(version.content),
        )

    async def read_acl(
        self, tenant_id: str, document_id: uuid.UUID, version_number: int
    ) -> frozenset[str]:
        return self._state.acl.get((tenant_id, document_id, version_number), frozenset())

    async def insert_document(
        self, tenant_id: str, document_id: uuid.UUID, title: str, now: datetime | None
    ) -> None:
        if tenant_id not in self._state.tenants:
            raise Conflict(f"no tenant {tenant_id}", code="FOREIGN_KEY_VIOLATION")
        if (tenant_id, document_id) in self._state.documents:
            raise Conflict("document exists", code="UNIQUE_VIOLATION")
        self._state.documents[(tenant_id, document_id)] = _Document(title, 1, 1)

    async def insert_version(self, version: NewVersion, now: datetime | None) -> None:
        key = (version.tenant_id, version.document_id, version.version_number)
        if key in self._state.versions:
            raise Conflict("version exists", code="UNIQUE_VIOLATION")
        self._state.versions[key] = _Version(version.content, version.media_type, version.sha256)

    async def record_new_version(
        self, tenant_id: str, document_id: uuid.UUID, version_number: int, now: datetime | None
    ) -> int:
        doc = self._state.documents[(tenant_id, document_id)]
        doc.latest_version = version_number
        doc.revision += 1
        return doc.revision

    async def publish_version(
        self, tenant_id: str, document_id: uuid.UUID, version_number: int, now: datetime | None
    ) -> int:
        version = self._state.versions[(tenant_id, document_id, version_number)]
        version.status = "PUBLISHED"
        version.published_at = version.published_at or _now(now)
        doc = self._state.documents[(tenant_id, document_id)]
        if doc.published_version != version_number:
            doc.published_at = _now(now)
        doc.published_version = version_number
        doc.revision += 1
        return doc.revision

    async def replace_acl(
        self,
        tenant_id: str,
        document_id: uuid.UUID,
        version_number: int,
        read_principals: frozenset[str],
    ) -> None:
        # The version's ACL (the fake has no search pointer, so no served ACL).
        self._state.acl[(tenant_id, document_id, version_number)] = frozenset(read_principals)

    async def ensure_index_task(self, task: NewIndexTask, now: datetime | None) -> EnqueuedTask:
        existing = await self.find_index_task(
            task.tenant_id, task.document_id, task.version_number, task.task_type
        )
        if existing is not None:
            return EnqueuedTask(existing, created=False)
        at = _now(now)
        self._state.tasks[task.task_id] = IndexTaskRecord(
            **asdict(task),
            status=TaskStatus.PENDING,
            attempts=0,
            max_attempts=DEFAULT_MAX_ATTEMPTS,
            lease_owner=None,
            lease_until=None,
            next_attempt_at=at,
            error_code=None,
            error_message=None,
            created_at=at,
            updated_at=at,
            finished_at=None,
        )
        return EnqueuedTask(task.task_id, created=True)

    async def find_index_task(
        self, tenant_id: str, document_id: uuid.UUID, version_number: int, task_type: str
    ) -> uuid.UUID | None:
        for task in self._state.tasks.values():
            if (task.tenant_id, task.document_id, task.version_number, task.task_type) == (
                tenant_id,
                document_id,
                version_number,
                task_type,
            ):
                return task.task_id
        return None

    async def delete_document(
        self, document: LockedDocument, now: datetime | None
    ) -> DocumentDeletion:
        key = (document.tenant_id, document.document_id)
        at = _now(now)
        cancelled = 0
        for task_id, task in list(self._state.tasks.items()):
            if (task.tenant_id, task.document_id) == key and task.status in (
                TaskStatus.PENDING,
                TaskStatus.RUNNING,
                TaskStatus.RETRY_WAIT,
            ):
                self._state.tasks[task_id] = replace(
                    task,
                    status=TaskStatus.DEAD,
                    error_code="DOCUMENT_DELETED",
                    error_message="the document was deleted",
                    lease_owner=None,
                    lease_until=None,
                    finished_at=at,
                    updated_at=at,
                )
                cancelled += 1
        served = self._state.search.pop(key, None)
        doc = self._state.documents[key]
        doc.deleted_at = at
        doc.revision += 1
        return DocumentDeletion(
            revision=doc.revision,
            deleted_at=at,
            previous_search_version=served[0] if served else None,
            cancelled_tasks=cancelled,
        )

    async def start_erasure(
        self,
        tenant_id: str,
        document_id: uuid.UUID,
        request: ErasureRequest,
        now: datetime | None,
    ) -> ErasureRecord:
        return self._state.erasures.setdefault(
            (tenant_id, document_id), ErasureRecord(requested_at=_now(now), erased_at=None)
        )

    async def add_event(self, event: PendingEvent) -> None:
        if any(e.event_id == event.event_id for e in self._state.outbox):
            raise Conflict("event id exists", code="UNIQUE_VIOLATION")
        self._state.outbox.append(event)


class MemoryPublisherStore:
    def __init__(self) -> None:
        self._state = _State()
        self._lock = asyncio.Lock()

    @contextlib.asynccontextmanager
    async def transaction(self, tenant_id: str) -> AsyncIterator[MemoryPublishTransaction]:
        async with self._lock:
            working = copy.deepcopy(self._state)
            yield MemoryPublishTransaction(working)
            self._state = working  # committed only when the block ended without an error

    async def api_key(
        self, tenant_id: str, key_hash: bytes, now: datetime | None = None
    ) -> ApiKeyGrant | None:
        # Every key of the fake is a tenant's first key: an admin key.
        if (tenant_id, key_hash) not in self._state.api_keys:
            return None
        return admin_grant(uuid.UUID(bytes=key_hash[:16]))

    async def verification_key(self, tenant_id: str, kid: str) -> VerificationKey | None:
        return None

    async def document_status(
        self, tenant_id: str, document_id: uuid.UUID
    ) -> DocumentStatusRecord | None:
        doc = self._state.documents.get((tenant_id, document_id))
        if doc is None:
            return None
        search = self._state.search.get((tenant_id, document_id))
        task = None
        if doc.published_version is not None:
            task = next(
                (
                    t
                    for t in self._state.tasks.values()
                    if (t.tenant_id, t.document_id, t.version_number, t.task_type)
                    == (tenant_id, document_id, doc.published_version, TASK_TYPE_INDEX_VERSION)
                ),
                None,
            )
        return DocumentStatusRecord(
            document_id=document_id,
            title=doc.title,
            revision=doc.revision,
            latest_version=doc.latest_version,
            published_version=doc.published_version,
            published_at=doc.published_at,
            deleted_at=doc.deleted_at,
            search_version=search[0] if search else None,
            search_switched_at=search[1] if search else None,
            task=task,
            # The fake has no WAL: every version is searchable "after the start".
            search_token="0/0" if search else None,
        )

    async def index_task(self, tenant_id: str, task_id: uuid.UUID) -> IndexTaskRecord | None:
        task = self._state.tasks.get(task_id)
        return task if task is not None and task.tenant_id == tenant_id else None

    async def primary_search_token(self) -> str:
        return "0/0"  # the fake has no WAL: every change is seen "after the start"

    async def readiness_problems(self) -> list[str]:
        return []

    # --- what tests arrange and inspect (the adapters' own tables, in PostgreSQL) ---------

    def add_tenant(self, tenant_id: str, tier: str, key_hash: bytes) -> None:
        self._state.tenants[tenant_id] = tier
        self._state.api_keys.add((tenant_id, key_hash))

    def events(self) -> list[PendingEvent]:
        return list(self._state.outbox)

    def finish_task(
        self,
        task_id: uuid.UUID,
        status: str,
        *,
        error_code: str | None = None,
        error_message: str | None = None,
    ) -> None:
        task = self._state.tasks[task_id]
        at = datetime.now(UTC)
        self._state.tasks[task_id] = replace(
            task,
            status=TaskStatus(status),
            error_code=error_code,
            error_message=error_message,
            finished_at=at,
            updated_at=at,
        )

    def switch_search_version(self, tenant_id: str, document_id: uuid.UUID, version: int) -> None:
        self._state.search[(tenant_id, document_id)] = (version, datetime.now(UTC))
