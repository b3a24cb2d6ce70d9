"""The publisher's PostgreSQL adapter: one method per named query in ``queries.sql``."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import KW_ONLY, asdict, dataclass
from datetime import datetime
from typing import Any, ClassVar, cast

import asyncpg

from services.publisher.ports import (
    PRIMARY,
    DocumentDeletion,
    DocumentStatusRecord,
    ErasureRecord,
    ErasureRequest,
    LockedDocument,
    NewVersion,
    PendingEvent,
    StatusReplicas,
    VersionInfo,
)
from services.runtime.auth.keys import ApiKeyGrant, PgTenantCredentials, VerificationKey
from services.runtime.errors import BadInput
from services.runtime.indexing.tasks import (
    TASK_TYPE_INDEX_VERSION,
    EnqueuedTask,
    IndexTaskRecord,
    NewIndexTask,
    enqueue_generation_tasks,
    enqueue_index_task,
    find_index_task,
    index_task_from_row,
)
from services.runtime.logging import get_logger
from services.runtime.messaging.outbox import OutboxEvent, add_event, aggregate_key
from services.runtime.pg.db import create_pool_without_session_reset, translate_db_errors
from services.runtime.pg.migrations import pending_migrations
from services.runtime.pg.records import from_row
from services.runtime.pg.sql import queries_beside
from services.runtime.settings import RuntimeSettings
from services.runtime.tenancy.served_acl import apply_served_acl, lock_first_pointer
from services.runtime.tenancy.tenant_wall import tenant_transaction

QUERIES = queries_beside(__file__, "queries.sql")

log = get_logger(__name__)


async def open_publisher_pool(settings: RuntimeSettings, **overrides: Any) -> asyncpg.Pool[Any]:
    """The publisher's pool. Released connections are not reset: the publisher keeps every
    lock and setting inside its transactions (the outbox's lock is transaction-scoped), so
    asyncpg's ``RESET ALL; UNLISTEN *; ...`` on release would be one more round trip per
    request -- the API key check of every tenant request included -- undoing nothing."""
    return await create_pool_without_session_reset(settings, **overrides)


def _task_of_status_row(row: asyncpg.Record) -> IndexTaskRecord:
    """The published version's task from a ``document_status`` row (its columns carry a
    ``task_`` prefix there, beside the document's own)."""
    return index_task_from_row(
        {key.removeprefix("task_"): value for key, value in row.items() if key.startswith("task_")}
    )


def outbox_event(event: PendingEvent) -> OutboxEvent:
    """The outbox's row of ``event``: its aggregate key names the document."""
    return OutboxEvent(
        event_type=event.event_type,
        tenant_id=event.tenant_id,
        tier=event.tier,
        aggregate_key=aggregate_key(event.tenant_id, event.document_id),
        payload=event.payload,
        event_id=event.event_id,
        traceparent=event.traceparent,
    )


class PgPublishTransaction:
    def __init__(self, conn: asyncpg.Connection[Any]) -> None:
        self._conn = conn

    async def lock_document(self, tenant_id: str, document_id: uuid.UUID) -> LockedDocument | None:
        with translate_db_errors():
            row = await self._conn.fetchrow(QUERIES["lock_document"], tenant_id, document_id)
        return None if row is None else from_row(LockedDocument, row)

    async def get_version(
        self, tenant_id: str, document_id: uuid.UUID, version_number: int
    ) -> VersionInfo | None:
        with translate_db_errors():
            row = await self._conn.fetchrow(
                QUERIES["get_version"], tenant_id, document_id, version_number
            )
        return None if row is None else from_row(VersionInfo, row, sha256=bytes(row["sha256"]))

    async def read_acl(
        self, tenant_id: str, document_id: uuid.UUID, version_number: int
    ) -> frozenset[str]:
        with translate_db_errors():
            rows = await self._conn.fetch(
                QUERIES["read_acl"], tenant_id, document_id, version_number
            )
        return frozenset(row["principal"] for row in rows)

    async def insert_document(
        self, tenant_id: str, document_id: uuid.UUID, title: str, now: datetime | None
    ) -> None:
        with translate_db_errors():
            await self._conn.execute(QUERIES["insert_document"], tenant_id, document_id, title, now)

    async def insert_version(self, version: NewVersion, now: datetime | None) -> None:
        with translate_db_errors():
            await self._conn.execute(
                QUERIES["insert_version"],
                version.tenant_id,
                version.document_id,
                version.version_number,
                version.content,
                version.media_type,
                version.sha256,
                now,
            )

    async def record_new_version(
        self, tenant_id: str, document_id: uuid.UUID, version_number: int, now: datetime | None
    ) -> int:
        with translate_db_errors():
            revision: int = await self._conn.fetchval(
                QUERIES["record_new_version"], tenant_id, document_id, version_number, now
            )
        return revision

    async def publish_version(
        self, tenant_id: str, document_id: uuid.UUID, version_number: int, now: datetime | None
    ) -> int:
        """The version marked published, then the document pointed at it; its new revision."""
        key = (tenant_id, document_id, version_number)
        with translate_db_errors():
            await self._conn.execute(QUERIES["mark_version_published"], *key, now)
            revision: int = await self._conn.fetchval(QUERIES["set_published_version"], *key, now)
        return revision

    async def replace_acl(
        self,
        tenant_id: str,
        document_id: uuid.UUID,
        version_number: int,
        read_principals: frozenset[str],
    ) -> None:
        """The version's ACL replaced, then the served ACL (the one search reads) when the
        version is the one search serves: the pointer row is locked after the document row
        (queries.sql: lock_search_pointer gives the lock order), so a completion switching the
        pointer to this version either committed before (its switch is seen, and this ACL
        applied after it) or waits, and then applies this ACL itself."""
        with translate_db_errors():
            await self._conn.execute(QUERIES["delete_acl"], tenant_id, document_id, version_number)
            if read_principals:
                await self._conn.execute(
                    QUERIES["insert_acl"],
                    tenant_id,
                    document_id,
                    version_number,
                    sorted(read_principals),
                )
            served = await self._conn.fetchval(
                QUERIES["lock_search_pointer"], tenant_id, document_id
            )
        if served is None:
            # No pointer row to lock: a completion may be inserting the first one right now
            # (services/runtime/tenancy/served_acl.sql: lock_first_pointer); read it again after it.
            await lock_first_pointer(self._conn, tenant_id, [document_id])
            with translate_db_errors():
                served = await self._conn.fetchval(
                    QUERIES["lock_search_pointer"], tenant_id, document_id
                )
        if served == version_number:
            await apply_served_acl(self._conn, tenant_id, [document_id])

    async def ensure_index_task(self, task: NewIndexTask, now: datetime | None) -> EnqueuedTask:
        """The task of the tenant's serving generation, and one per generation the tenant is
        built in beside it (the dual write: those get no event of their own; the serving
        task's event wakes the tier's indexers, which claim them too)."""
        enqueued = await enqueue_index_task(self._conn, **asdict(task), now=now)
        await enqueue_generation_tasks(
            self._conn,
            tenant_id=task.tenant_id,
            tier=task.tier,
            versions=[(task.document_id, task.version_number)],
            task_type=task.task_type,
            now=now,
        )
        return enqueued

    async def find_index_task(
        self, tenant_id: str, document_id: uuid.UUID, version_number: int, task_type: str
    ) -> uuid.UUID | None:
        return await find_index_task(self._conn, tenant_id, document_id, version_number, task_type)

    async def delete_document(
        self, document: LockedDocument, now: datetime | None
    ) -> DocumentDeletion:
        """In the lock order of a publish (queries.sql: lock_search_pointer): the document row
        (locked by the caller), the task rows, the pointer row, the served ACL rows; the
        caller's event takes the outbox's lock last."""
        tenant_id, document_id = document.tenant_id, document.document_id
        with translate_db_errors():
            cancelled = await self._conn.fetch(
                QUERIES["cancel_document_tasks"],
                tenant_id,
                document_id,
                "the document was deleted",
                now,
            )
            if cancelled:
                await self._conn.fetchval(
                    QUERIES["discard_deleted_tasks_staging"],
                    tenant_id,
                    [row["task_id"] for row in cancelled],
                )
            previous = await self._conn.fetchrow(
                QUERIES["tombstone_search_pointer"],
                tenant_id,
                document_id,
                document.latest_version,
                now,
            )
            await self._conn.execute(QUERIES["delete_served_acl"], tenant_id, document_id)
            marked = await self._conn.fetchrow(
                QUERIES["mark_document_deleted"], tenant_id, document_id, now
            )
        # The document row is ours (lock_document) and was not deleted: the pointer cannot be
        # a tombstone already, nor the mark refused.
        assert previous is not None
        assert marked is not None
        return DocumentDeletion(
            revision=marked["revision"],
            deleted_at=marked["deleted_at"],
            previous_search_version=previous["previous_version"],
            cancelled_tasks=len(cancelled),
        )

    async def start_erasure(
        self,
        tenant_id: str,
        document_id: uuid.UUID,
        request: ErasureRequest,
        now: datetime | None,
    ) -> ErasureRecord:
        with translate_db_errors():
            row = await self._conn.fetchrow(
                QUERIES["start_erasure"],
                tenant_id,
                document_id,
                request.key_id,
                request.requested_by,
                now,
            )
        assert row is not None  # inserted, or there already
        return ErasureRecord(requested_at=row["requested_at"], erased_at=row["erased_at"])

    async def add_event(self, event: PendingEvent) -> None:
        await add_event(self._conn, outbox_event(event))


# Mutable (read_status_on) and compared by identity, as the plain class it was.
@dataclass(eq=False)
class PgPublisherStore:
    # What ``transaction`` yields: the ingest consumer's store yields its own kind
    # (services/publisher/ingest/store_pg.py), the same transaction with more statements.
    transaction_class: ClassVar[type[PgPublishTransaction]] = PgPublishTransaction

    pool: asyncpg.Pool[Any]
    _: KW_ONLY
    # A request waits this long for a connection, then answers 503: with every connection
    # busy (or the database hanging) requests must not pile up, each holding its upload.
    acquire_timeout_seconds: float = 10.0
    readiness_timeout_seconds: float = 2.0
    status_replicas: StatusReplicas | None = None
    # KB_DB_ROW_SECURITY: a tenant's transactions and reads behind the database's wall.
    row_security: bool = True

    def _connection(self) -> Any:
        return self.pool.acquire(timeout=self.acquire_timeout_seconds)

    def read_status_on(self, replicas: StatusReplicas | None) -> None:
        """Read documents' status on these replicas from now on (services/app.py, once
        search's replica rotation is open); None: on the primary only."""
        self.status_replicas = replicas

    @contextlib.asynccontextmanager
    async def transaction(self, tenant_id: str) -> AsyncIterator[PgPublishTransaction]:
        with translate_db_errors():
            async with (
                self._connection() as conn,
                tenant_transaction(conn, tenant_id, row_security=self.row_security),
            ):
                # The pool's proxy forwards every call to the connection it wraps.
                yield self.transaction_class(cast("asyncpg.Connection[Any]", conn))

    async def api_key(
        self, tenant_id: str, key_hash: bytes, now: datetime | None = None
    ) -> ApiKeyGrant | None:
        return await PgTenantCredentials(self._connection).api_key(tenant_id, key_hash, now)

    async def verification_key(self, tenant_id: str, kid: str) -> VerificationKey | None:
        return await PgTenantCredentials(self._connection).verification_key(tenant_id, kid)

    async def document_status(
        self, tenant_id: str, document_id: uuid.UUID
    ) -> DocumentStatusRecord | None:
        """Read on a replica in rotation when there is one (docs/scaling.md#status-on-replicas);
        a status the replica cannot answer (the document not replayed there yet, or the
        replica failing) is read on the primary, so a client never sees 404 for a document
        the primary has. The search token stays safe on either (queries.sql)."""
        replicas = self.status_replicas
        replica = replicas.next_replica() if replicas is not None else None
        if replica is not None:
            name, pool = replica
            try:
                row = await self._status_row(pool, tenant_id, document_id)
            except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError) as error:
                log.warning(
                    "document.status_replica_failed", replica=name, error=type(error).__name__
                )
                row = None
            if row is not None:
                return self._status_record(row, name)
        with translate_db_errors():
            row = await self._status_row(self.pool, tenant_id, document_id)
        return self._status_record(row, PRIMARY) if row is not None else None

    async def _status_row(
        self, pool: asyncpg.Pool[Any], tenant_id: str, document_id: uuid.UUID
    ) -> asyncpg.Record | None:
        async with (
            pool.acquire(timeout=self.acquire_timeout_seconds) as conn,
            self._tenant_read(conn, tenant_id),
        ):
            row: asyncpg.Record | None = await conn.fetchrow(
                QUERIES["document_status"], tenant_id, document_id, TASK_TYPE_INDEX_VERSION
            )
        return row

    def _tenant_read(self, conn: Any, tenant_id: str) -> Any:
        """A single read of the tenant's: behind the wall in a read-only transaction (two
        more round trips: BEGIN with the wall, COMMIT); without the wall, as it is."""
        if not self.row_security:
            return contextlib.nullcontext()
        return tenant_transaction(conn, tenant_id, row_security=True, read_only=True)

    @staticmethod
    def _status_record(row: asyncpg.Record, read_from: str) -> DocumentStatusRecord:
        task = _task_of_status_row(row) if row["task_task_id"] is not None else None
        return from_row(DocumentStatusRecord, row, task=task, read_from=read_from)

    async def index_task(self, tenant_id: str, task_id: uuid.UUID) -> IndexTaskRecord | None:
        with translate_db_errors():
            async with self._connection() as conn, self._tenant_read(conn, tenant_id):
                row = await conn.fetchrow(QUERIES["index_task"], tenant_id, task_id)
        return index_task_from_row(row) if row is not None else None

    async def primary_search_token(self) -> str:
        with translate_db_errors():
            async with self._connection() as conn:
                token: str = await conn.fetchval(QUERIES["primary_search_token"])
        return token

    async def readiness_problems(self) -> list[str]:
        # A probe must answer quickly: an unreachable database or a full pool is "not
        # ready", not a hang (the caller caches the answer, so probes do not drain the pool).
        timeout = self.readiness_timeout_seconds
        with translate_db_errors():
            async with asyncio.timeout(timeout), self.pool.acquire(timeout=timeout) as conn:
                await conn.fetchval(QUERIES["ping"])
                pending = await pending_migrations(cast("asyncpg.Connection[Any]", conn))
        return [f"migration {m.version:04d}_{m.name} is not applied" for m in pending]


class PgTenantStore:
    """Tenants and their API keys (the `kb tenants` commands)."""

    def __init__(self, conn: asyncpg.Connection[Any]) -> None:
        self._conn = conn

    async def create_tenant(self, tenant_id: str, tier: str, key_hash: bytes) -> None:
        with translate_db_errors():
            async with self._conn.transaction():
                created = await self._conn.fetchval(QUERIES["insert_tenant"], tenant_id, tier)
                if created is None:
                    raise BadInput(f"tenant {tenant_id!r} already exists", code="TENANT_EXISTS")
                await self._conn.execute(
                    QUERIES["insert_api_key"], uuid.uuid4(), tenant_id, key_hash
                )
