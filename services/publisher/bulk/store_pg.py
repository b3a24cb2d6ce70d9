"""The bulk store on PostgreSQL: a batch of new documents in one transaction, one statement
per table (``queries.sql``)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from datetime import datetime
from typing import Any

import asyncpg

from services.publisher.bulk.domain import NewPublishedDocument
from services.publisher.ports import PendingEvent
from services.publisher.store_pg import outbox_event
from services.runtime.errors import NotFound
from services.runtime.indexing.tasks import DEFAULT_MAX_ATTEMPTS, enqueue_generation_tasks
from services.runtime.messaging.outbox import add_events_of_new_aggregates
from services.runtime.pg.db import translate_db_errors
from services.runtime.pg.sql import queries_beside
from services.runtime.tenancy.tenant_wall import tenant_transaction

QUERIES = queries_beside(__file__)


class PgBulkStore:
    def __init__(
        self,
        pool: asyncpg.Pool[Any] | None,
        *,
        acquire_timeout_seconds: float = 10.0,
        row_security: bool = True,
        connection: Any = None,
    ) -> None:
        self._pool = pool
        self._acquire_timeout = acquire_timeout_seconds
        # KB_DB_ROW_SECURITY: the batch's transaction behind the tenant wall.
        self._row_security = row_security
        # A transaction already open behind the wall (the ingest consumer's run of commands,
        # services/publisher/ingest/runs.py): the documents are written in it.
        self._open = connection

    @contextlib.asynccontextmanager
    async def _transaction(self, tenant_id: str) -> AsyncIterator[Any]:
        if self._open is not None:
            yield self._open
            return
        assert self._pool is not None  # one of the two is given
        async with (
            self._pool.acquire(timeout=self._acquire_timeout) as conn,
            tenant_transaction(conn, tenant_id, row_security=self._row_security),
        ):
            yield conn

    async def tenant_tier(self, tenant_id: str) -> str:
        assert self._pool is not None
        with translate_db_errors():
            tier: str | None = await self._pool.fetchval(QUERIES["tenant_tier"], tenant_id)
        if tier is None:
            raise NotFound(f"no tenant {tenant_id!r}", code="TENANT_NOT_FOUND")
        return tier

    async def insert_published_documents(
        self,
        tenant_id: str,
        tier: str,
        documents: Sequence[NewPublishedDocument],
        events: Sequence[PendingEvent],
        now: datetime | None,
    ) -> None:
        acl = [(d.document_id, p) for d in documents for p in sorted(d.read_principals)]
        with translate_db_errors():
            async with self._transaction(tenant_id) as conn:
                await conn.execute(
                    QUERIES["insert_published_documents"],
                    tenant_id,
                    tier,
                    [d.document_id for d in documents],
                    [d.title for d in documents],
                    [d.content for d in documents],
                    [d.media_type for d in documents],
                    [d.sha256 for d in documents],
                    [d.index_task_id for d in documents],
                    DEFAULT_MAX_ATTEMPTS,
                    now,
                    [d.traceparent for d in documents],
                )
                # The dual write, as a single publish does (services.runtime.indexing.tasks).
                await enqueue_generation_tasks(
                    conn,
                    tenant_id=tenant_id,
                    tier=tier,
                    versions=[(d.document_id, 1) for d in documents],
                    now=now,
                    traceparents=[d.traceparent for d in documents],
                )
                if acl:
                    await conn.execute(
                        QUERIES["insert_acls"],
                        tenant_id,
                        [document_id for document_id, _ in acl],
                        [principal for _, principal in acl],
                    )
                # Each document's task event, then its published event, in this order.
                await add_events_of_new_aggregates(conn, [outbox_event(e) for e in events])
