"""The ingest consumer's PostgreSQL adapter: the publisher's transaction (its every
statement reused, not copied) with the command record and the key map beside it."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Sequence
from datetime import datetime
from typing import Any, cast

import asyncpg

from services.publisher.bulk.store_pg import PgBulkStore
from services.publisher.ingest.commands import Command
from services.publisher.ingest.ports import Backlog, Claims, CommandAnswer
from services.publisher.ingest.signing import IngestKey
from services.publisher.store_pg import PgPublisherStore, PgPublishTransaction
from services.runtime.errors import Conflict, NotFound
from services.runtime.pg.db import translate_db_errors
from services.runtime.pg.sql import queries_beside

QUERIES = queries_beside(__file__, "ingest.sql")


class DocumentKeyTaken(Conflict, code="INGEST_DOCUMENT_KEY_TAKEN"):
    """The upload's document is mapped to another producer key already."""


class PgIngestTransaction(PgPublishTransaction):
    @property
    def connection(self) -> asyncpg.Connection[Any]:
        return self._conn

    async def claim_command(
        self, command: Command, now: datetime | None, sent_at: datetime | None
    ) -> bool:
        key = (command.tenant_id, command.command_id, command.command_type)
        with translate_db_errors():
            claimed = await self._conn.fetchval(QUERIES["claim_command"], *key, now, sent_at)
        return claimed is not None

    async def command_answer(self, tenant_id: str, command_id: uuid.UUID) -> CommandAnswer | None:
        with translate_db_errors():
            row = await self._conn.fetchrow(QUERIES["command_answer"], tenant_id, command_id)
        return None if row is None else CommandAnswer(**dict(row))

    async def command_answers(
        self, tenant_id: str, command_ids: Sequence[uuid.UUID]
    ) -> dict[uuid.UUID, CommandAnswer]:
        with translate_db_errors():
            rows = await self._conn.fetch(QUERIES["command_answers"], tenant_id, command_ids)
        return {row["command_id"]: CommandAnswer(**dict(row)) for row in rows}

    @contextlib.asynccontextmanager
    async def savepoint(self) -> AsyncIterator[None]:
        with translate_db_errors():
            await self._conn.execute(QUERIES["savepoint"])
        try:
            yield
        except Exception:
            with translate_db_errors():
                await self._conn.execute(QUERIES["rollback_to_savepoint"])
                # Let go too: a run refusing many commands keeps no stack of savepoints.
                await self._conn.execute(QUERIES["release_savepoint"])
            raise
        with translate_db_errors():
            await self._conn.execute(QUERIES["release_savepoint"])

    async def documents_for_keys(
        self, tenant_id: str, document_keys: Sequence[str]
    ) -> dict[str, uuid.UUID]:
        with translate_db_errors():
            rows = await self._conn.fetch(QUERIES["documents_for_keys"], tenant_id, document_keys)
        return {row["document_key"]: row["document_id"] for row in rows}

    async def claim_commands(self, tenant_id: str, claims: Claims, now: datetime | None) -> int:
        with translate_db_errors():
            rows = await self._conn.fetch(
                QUERIES["claim_commands"],
                tenant_id,
                [c.command_id for c, _ in claims],
                [c.command_type for c, _ in claims],
                [sent_at for _, sent_at in claims],
                now,
            )
        return len(rows)

    async def map_keys(
        self, tenant_id: str, pairs: Sequence[tuple[str, uuid.UUID]], now: datetime | None
    ) -> None:
        with translate_db_errors():
            await self._conn.execute(
                QUERIES["map_keys"], tenant_id, [k for k, _ in pairs], [d for _, d in pairs], now
            )

    async def record_answers(self, tenant_id: str, answers: Sequence[CommandAnswer]) -> None:
        columns = list(zip(*(a.stored() for a in answers), strict=True))
        with translate_db_errors():
            await self._conn.execute(QUERIES["record_answers"], tenant_id, *columns)

    def bulk(self) -> PgBulkStore:
        return PgBulkStore(None, connection=self._conn)

    async def refusals_sent(self, tenant_id: str, sources: Sequence[str]) -> dict[str, str]:
        with translate_db_errors():
            rows = await self._conn.fetch(QUERIES["refusals_sent"], tenant_id, sources)
        return {row["source"]: row["code"] for row in rows}

    async def record_refusal(
        self, tenant_id: str, source: str, command_id: uuid.UUID, code: str, now: datetime | None
    ) -> None:
        with translate_db_errors():
            await self._conn.execute(
                QUERIES["record_refusal"], tenant_id, source, command_id, code, now
            )

    async def record_answer(self, tenant_id: str, answer: CommandAnswer) -> None:
        with translate_db_errors():
            await self._conn.execute(QUERIES["record_answer"], tenant_id, *answer.stored())

    async def document_for_key(self, tenant_id: str, document_key: str) -> uuid.UUID | None:
        with translate_db_errors():
            found: uuid.UUID | None = await self._conn.fetchval(
                QUERIES["document_for_key"], tenant_id, document_key
            )
        return found

    async def forget_key(self, tenant_id: str, document_key: str) -> None:
        with translate_db_errors():
            await self._conn.execute(QUERIES["forget_key"], tenant_id, document_key)

    async def forget_document_key(self, tenant_id: str, document_id: uuid.UUID) -> None:
        with translate_db_errors():
            await self._conn.execute(QUERIES["forget_document_key"], tenant_id, document_id)

    async def map_key(
        self, tenant_id: str, document_key: str, document_id: uuid.UUID, now: datetime | None
    ) -> None:
        with translate_db_errors():
            mapped = await self._conn.fetchval(
                QUERIES["map_key"], tenant_id, document_key, document_id, now
            )
        if mapped is None:
            raise DocumentKeyTaken(
                f"document {document_id} belongs to another producer key in this tenant"
            )


class PgIngestStore(PgPublisherStore):
    transaction_class = PgIngestTransaction

    @contextlib.asynccontextmanager
    async def ingest_transaction(self, tenant_id: str) -> AsyncIterator[PgIngestTransaction]:
        async with self.transaction(tenant_id) as tx:
            yield cast("PgIngestTransaction", tx)

    async def add_ingest_key(
        self, tenant_id: str, key_id: str, public_key: bytes
    ) -> datetime | None:
        async with self.ingest_transaction(tenant_id) as tx:
            return await PgIngestKeys(tx.connection).add(tenant_id, key_id, public_key)

    async def list_ingest_keys(self, tenant_id: str) -> list[dict[str, Any]]:
        async with self.ingest_transaction(tenant_id) as tx:
            return await PgIngestKeys(tx.connection).list(tenant_id)

    async def revoke_ingest_key(self, tenant_id: str, key_id: str) -> datetime | None:
        async with self.ingest_transaction(tenant_id) as tx:
            return await PgIngestKeys(tx.connection).revoke(tenant_id, key_id)

    async def tenant_tier(self, tenant_id: str) -> str | None:
        try:
            return await PgBulkStore(self.pool).tenant_tier(tenant_id)
        except NotFound:
            return None

    async def ingest_keys(
        self, tenant_id: str, key_ids: Sequence[str], now: datetime | None = None
    ) -> dict[str, IngestKey]:
        with translate_db_errors():
            async with self._connection() as conn, self._tenant_read(conn, tenant_id):
                rows = await conn.fetch(QUERIES["find_ingest_keys"], tenant_id, key_ids, now)
        return {r["key_id"]: IngestKey(r["key_id"], bytes(r["public_key"])) for r in rows}

    async def report_backlog(
        self,
        tier: str,
        consumer_id: uuid.UUID,
        held: dict[str, Backlog],
        now: datetime | None = None,
    ) -> None:
        tenants = sorted(held)
        with translate_db_errors():
            async with self._connection() as conn:
                await conn.execute(
                    QUERIES["report_backlog"],
                    tier,
                    consumer_id,
                    tenants,
                    [held[t].records for t in tenants],
                    [held[t].oldest_sent_at for t in tenants],
                    now,
                )

    async def remove_refusals(self, days: int, most: int, now: datetime | None = None) -> int:
        return await self._remove("remove_refusals", days, most, now)

    async def remove_commands(self, days: int, most: int, now: datetime | None = None) -> int:
        return await self._remove("remove_commands", days, most, now)

    async def _remove(self, query: str, days: int, most: int, now: datetime | None) -> int:
        """A retention batch (ingest.sql's ``remove_*``): how many rows went."""
        with translate_db_errors():
            async with self._connection() as conn:
                status = await conn.execute(QUERIES[query], days, most, now)
        return int(status.rsplit(" ", 1)[-1])


class PgIngestKeys:
    """A tenant's ingest keys, written as the tables' owner (`kb tenants ingest-keys`)."""

    def __init__(self, conn: asyncpg.Connection[Any]) -> None:
        self._conn = conn

    async def add(self, tenant_id: str, key_id: str, public_key: bytes) -> datetime | None:
        """When the key was added; None when the tenant has a key of that id already."""
        with translate_db_errors():
            created: datetime | None = await self._conn.fetchval(
                QUERIES["add_ingest_key"], tenant_id, key_id, public_key
            )
        return created

    async def list(self, tenant_id: str) -> list[dict[str, Any]]:
        with translate_db_errors():
            rows = await self._conn.fetch(QUERIES["list_ingest_keys"], tenant_id)
        return [dict(row) for row in rows]

    async def revoke(self, tenant_id: str, key_id: str) -> datetime | None:
        with translate_db_errors():
            revoked: datetime | None = await self._conn.fetchval(
                QUERIES["revoke_ingest_key"], tenant_id, key_id, None
            )
        return revoked
