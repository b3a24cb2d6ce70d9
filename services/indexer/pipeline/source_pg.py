"""Stored document versions read from PostgreSQL (``load_document_versions``), tenant-scoped.

The versions the slots of one claim load at once are read in one query
(services/runtime/pg/coalesce.py)."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import asyncpg

from services.indexer.ports import StoredVersion
from services.runtime.pg.coalesce import Coalesced
from services.runtime.pg.db import translate_db_errors
from services.runtime.pg.records import from_row
from services.runtime.pg.sql import queries_beside

QUERIES = queries_beside(__file__, "source.sql")

VersionKey = tuple[str, uuid.UUID, int]


class PgVersionSource:
    def __init__(self, pool: asyncpg.Pool[Any]) -> None:
        self._pool = pool
        # A few versions at a time: a version may be large (the parse pool takes documents
        # of many megabytes), and one query's rows are held together.
        self._versions: Coalesced[VersionKey, StoredVersion] = Coalesced(
            self._load_many, max_keys=32
        )

    async def load(
        self, tenant_id: str, document_id: uuid.UUID, version_number: int
    ) -> StoredVersion | None:
        return await self._versions.get((tenant_id, document_id, version_number))

    async def _load_many(self, keys: Sequence[VersionKey]) -> Mapping[VersionKey, StoredVersion]:
        with translate_db_errors():
            rows = await self._pool.fetch(
                QUERIES["load_document_versions"],
                [tenant_id for tenant_id, _, _ in keys],
                [document_id for _, document_id, _ in keys],
                [version_number for _, _, version_number in keys],
            )
        return {
            (row["tenant_id"], row["document_id"], row["version_number"]): from_row(
                StoredVersion, row, sha256=bytes(row["sha256"])
            )
            for row in rows
        }
