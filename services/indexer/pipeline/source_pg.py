"""Stored document versions read from PostgreSQL (``load_document_version``), tenant-scoped."""

from __future__ import annotations

import uuid
from typing import Any

import asyncpg

from services.indexer.ports import StoredVersion
from services.runtime.db import translate_db_errors
from services.runtime.records import from_row
from services.runtime.sql import queries_beside

QUERIES = queries_beside(__file__, "source.sql")


class PgVersionSource:
    def __init__(self, pool: asyncpg.Pool[Any]) -> None:
        self._pool = pool

    async def load(
        self, tenant_id: str, document_id: uuid.UUID, version_number: int
    ) -> StoredVersion | None:
        with translate_db_errors():
            row = await self._pool.fetchrow(
                QUERIES["load_document_version"], tenant_id, document_id, version_number
            )
        return None if row is None else from_row(StoredVersion, row, sha256=bytes(row["sha256"]))
