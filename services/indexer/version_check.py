"""A STAND-IN ``DocumentVersionIndexer`` until the real pipeline (parse -> chunk -> embed ->
pgvector sink) lands.

It does the first, honest step of that pipeline and nothing more: it loads the immutable
``document_version`` row (tenant-scoped), checks that the stored bytes still match their
recorded sha256 and size, and that the media type is one the pipeline will parse. It writes
no chunks and moves no search pointer; a SUCCEEDED task from it means "the version is
intact and indexable", not "searchable". The CLI wires it in only because nothing else
exists yet.
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any, Final

import asyncpg

from services.indexer.ports import DocumentVersionIndexer, IndexingOutcome
from services.indexer.task import ErrorCode, IndexingFailed, Lease
from services.runtime.db import translate_db_errors
from services.runtime.sql import queries_beside

QUERIES = queries_beside(__file__, "queries.sql")

# What the pipeline will parse (DESIGN §6): text, Markdown, HTML, PDF, DOCX.
SUPPORTED_MEDIA_TYPES: Final[frozenset[str]] = frozenset(
    {
        "text/plain",
        "text/markdown",
        "text/html",
        "application/pdf",
        "application/vnd.openxmlformats-officedocument.wordprocessingml.document",
    }
)


class VersionCheckIndexer:
    """Stand-in: verifies the version's integrity and media type; indexes nothing."""

    def __init__(self, pool: asyncpg.Pool[Any]) -> None:
        self._pool = pool

    async def index(self, lease: Lease) -> IndexingOutcome:
        with translate_db_errors():
            row = await self._pool.fetchrow(
                QUERIES["load_document_version"],
                lease.tenant_id,
                lease.document_id,
                lease.version_number,
            )
        if row is None:
            raise IndexingFailed(
                ErrorCode.DOCUMENT_VERSION_MISSING,
                f"document {lease.document_id} version {lease.version_number} does not exist",
            )
        media_type = str(row["media_type"]).split(";", 1)[0].strip().lower()
        if media_type not in SUPPORTED_MEDIA_TYPES:
            raise IndexingFailed(
                ErrorCode.UNSUPPORTED_DOCUMENT, f"media type {media_type!r} is not supported"
            )
        content: bytes = row["content"]
        if len(content) != row["size_bytes"]:
            raise IndexingFailed(
                ErrorCode.DOCUMENT_PARSE_FAILED,
                f"content is {len(content)} bytes, {row['size_bytes']} recorded",
            )
        if hashlib.sha256(content).digest() != bytes(row["sha256"]):
            raise IndexingFailed(
                ErrorCode.DOCUMENT_PARSE_FAILED, "content does not match its recorded sha256"
            )
        return IndexingOutcome()


class TestOnlyHangingIndexer:
    """FOR CRASH TESTS ONLY (``KB_INDEXER=test-only-hang``): hangs until cancelled on every
    lease generation up to ``hang_generations``, so a test can kill the worker mid-task;
    later generations (the takeover) run ``inner``."""

    __test__ = False  # not a pytest test class

    def __init__(self, inner: DocumentVersionIndexer, hang_generations: int) -> None:
        self._inner = inner
        self._hang_generations = hang_generations

    async def index(self, lease: Lease) -> IndexingOutcome:
        if lease.lease_attempt <= self._hang_generations:
            await asyncio.Event().wait()
        return await self._inner.index(lease)
