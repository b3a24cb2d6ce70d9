"""What the operator page reads and writes in PostgreSQL (named queries in queries.sql).

Reads only: requeues go through the indexer's audited task queue, the outbox backlog
through the relay's own query, so the page shows exactly what those services compute.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import asyncpg

from services.embedding.guard.ports import ProviderView
from services.embedding.guard.store_pg import PgProviderStateStore
from services.indexer.generations.model import GenerationStatus
from services.indexer.generations.store_pg import PgGenerations
from services.runtime.indexing.search_lag import QUERIES as search_lag_queries
from services.runtime.pg.db import translate_db_errors
from services.runtime.pg.sql import queries_beside

QUERIES = queries_beside(__file__, "queries.sql")
SEARCH_LAG = search_lag_queries


class _Pinned:
    """The page's clock: the pinned instant of a test, or None (the database's)."""

    def __init__(self, at: datetime | None) -> None:
        self._at = at

    def now(self) -> datetime | None:
        return self._at


@dataclass(frozen=True)
class Session:
    operator: str
    csrf_token: str


@dataclass(frozen=True)
class Page:
    rows: list[dict[str, Any]]
    offset: int
    limit: int
    total: int

    @property
    def has_next(self) -> bool:
        return self.offset + len(self.rows) < self.total

    @property
    def next_offset(self) -> int:
        return self.offset + self.limit

    @property
    def previous_offset(self) -> int | None:
        return max(0, self.offset - self.limit) if self.offset > 0 else None


class PgOperatorStore:
    def __init__(self, pool: asyncpg.Pool[Any], *, now: datetime | None = None) -> None:
        self._pool = pool
        self._now = now  # tests pin the clock; production reads the database's

    async def _fetch(self, name: str, *args: Any) -> list[dict[str, Any]]:
        with translate_db_errors():
            rows = await self._pool.fetch(QUERIES[name], *args)
        return [dict(row) for row in rows]

    async def _value(self, name: str, *args: Any) -> Any:
        with translate_db_errors():
            return await self._pool.fetchval(QUERIES[name], *args)

    # --- sign-in ---------------------------------------------------------------------------

    async def operator_for_key(self, key_hash: bytes) -> str | None:
        name: str | None = await self._value("find_operator_key", key_hash)
        return name

    async def create_operator_key(self, name: str, key_hash: bytes) -> uuid.UUID:
        operator_id: uuid.UUID = await self._value(
            "create_operator_key", uuid.uuid4(), name, key_hash
        )
        return operator_id

    async def create_session(
        self, session_hash: bytes, operator: str, csrf_token: str, lifetime_seconds: float
    ) -> None:
        with translate_db_errors():
            await self._pool.execute(QUERIES["delete_expired_sessions"], self._now)
            await self._pool.execute(
                QUERIES["create_session"],
                session_hash,
                operator,
                csrf_token,
                float(lifetime_seconds),
                self._now,
            )

    async def session(self, session_hash: bytes) -> Session | None:
        rows = await self._fetch("find_session", session_hash, self._now)
        if not rows:
            return None
        return Session(rows[0]["operator_name"], rows[0]["csrf_token"])

    async def end_session(self, session_hash: bytes) -> None:
        with translate_db_errors():
            await self._pool.execute(QUERIES["delete_session"], session_hash)

    # --- overview --------------------------------------------------------------------------

    async def tiers(self, expiring_within_seconds: float) -> list[dict[str, Any]]:
        return await self._fetch("tier_overview", float(expiring_within_seconds), self._now)

    async def search_lag(self) -> dict[str, Any]:
        """Documents whose search version lags the published one (the metric's query)."""
        with translate_db_errors():
            row = await self._pool.fetchrow(SEARCH_LAG["search_lag"], self._now)
        assert row is not None
        return dict(row)

    async def embedding_providers(self) -> list[ProviderView]:
        """The embedding providers' shared limiter pause and breaker (the guard's own read)."""
        return await PgProviderStateStore(self._pool, clock=_Pinned(self._now)).views()

    async def generations(self) -> list[GenerationStatus]:
        """Each generation not retired with its progress and the tenants it serves: what
        `kb index generations status` prints, without its scan of the chunks on disk."""
        return await PgGenerations(self._pool).status(None, on_disk=False, serving_shown=5)

    async def relay_partitions(self) -> list[dict[str, Any]]:
        return await self._fetch("relay_partitions", self._now)

    async def last_hour(self) -> tuple[datetime, list[dict[str, Any]], list[dict[str, Any]]]:
        """The window's end, finished tasks per minute, and publish->searchable samples."""
        with translate_db_errors():
            end: datetime = await self._pool.fetchval(QUERIES["database_now"], self._now)
        since = end - timedelta(hours=1)
        finished = await self._fetch("tasks_per_minute", since, end)
        latencies = await self._fetch("publish_to_switch_in_window", since, end)
        return end, finished, latencies

    # --- tenants and documents -------------------------------------------------------------

    async def tenants(self, after: str | None, limit: int) -> list[dict[str, Any]]:
        return await self._fetch("tenants_page", after, limit, self._now)

    async def documents(self, tenant_id: str, offset: int, limit: int) -> Page:
        rows = await self._fetch("documents_page", tenant_id, offset, limit, self._now)
        total = await self._value("count_documents", tenant_id)
        return Page(rows, offset, limit, int(total))

    async def document(
        self, tenant_id: str, document_id: uuid.UUID, *, chunk_offset: int, limit: int
    ) -> dict[str, Any] | None:
        header = await self._fetch("document_header", tenant_id, document_id)
        if not header:
            return None
        chunks = await self._fetch("document_chunks", tenant_id, document_id, chunk_offset, limit)
        chunk_total = await self._value("count_document_chunks", tenant_id, document_id)
        return {
            **header[0],
            "versions": await self._fetch("document_versions", tenant_id, document_id, limit),
            "tasks": await self._fetch("document_tasks", tenant_id, document_id, limit),
            "chunks": Page(chunks, chunk_offset, limit, int(chunk_total)),
        }

    # --- deletes, erasures, retention -------------------------------------------------------

    async def lifecycle_totals(self, retention_days: int) -> dict[str, Any]:
        [totals] = await self._fetch("lifecycle_totals", self._now, retention_days)
        return totals

    async def lifecycle(self, limit: int) -> dict[str, list[dict[str, Any]]]:
        """The latest deletes, erasures (the audit rows) and versions retention emptied."""
        return {
            name: await self._fetch(f"recent_{name}", limit)
            for name in ("deletes", "erasures", "retention")
        }

    # --- dead letters ----------------------------------------------------------------------

    async def dead_tasks(
        self,
        *,
        tier: str | None,
        tenant_id: str | None,
        error_code: str | None,
        offset: int,
        limit: int,
    ) -> Page:
        rows = await self._fetch("dead_tasks_page", tier, tenant_id, error_code, offset, limit)
        total = await self._value("count_dead_tasks", tier, tenant_id, error_code)
        return Page(rows, offset, limit, int(total))

    async def recent_requeues(self, limit: int) -> list[dict[str, Any]]:
        return await self._fetch("recent_requeues", limit)
