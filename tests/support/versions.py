"""Published versions and their chunks, written directly for the sink's tests."""

from __future__ import annotations

import hashlib
import uuid
from typing import Any

import asyncpg

from services.indexer.chunk import Chunk, chunk_id_of
from services.runtime.indexing.media_types import MARKDOWN
from tests.support.tasks import CreatedTask


async def publish_version(
    pool: asyncpg.Pool[Any], created: CreatedTask, version: int, content: bytes | None = None
) -> uuid.UUID:
    """Version ``version`` of the document, published, with its due index task."""
    task_id = uuid.uuid4()
    content = content if content is not None else f"refund policy v{version}".encode()
    await pool.execute(
        """
        WITH version AS (
            INSERT INTO document_version (tenant_id, document_id, version_number, content,
                                          media_type, sha256, size_bytes, status, published_at)
            VALUES ($1, $2, $3, $4, $9, $5, $6, 'PUBLISHED', now())
        ), doc AS (
            UPDATE document SET latest_version = $3, published_version = $3
             WHERE tenant_id = $1 AND document_id = $2
        )
        INSERT INTO index_task (task_id, tenant_id, document_id, version_number, tier,
                                next_attempt_at)
        VALUES ($7, $1, $2, $3, $8, now() - interval '1 hour')
        """,
        created.tenant_id,
        created.document_id,
        version,
        content,
        hashlib.sha256(content).digest(),
        len(content),
        task_id,
        created.tier,
        MARKDOWN if content.startswith(b"#") else "text/plain",
    )
    return task_id


def make_chunks(
    document_id: uuid.UUID,
    version: int,
    texts: list[str],
    strategy: str,
    *,
    heading: str = "Refund policy",
) -> list[Chunk]:
    """One chunk a text under one heading, with the ids the chunker would give them."""
    chunks = []
    for ordinal, text in enumerate(texts):
        path = (heading,)
        digest = hashlib.sha256(f"{heading}\n\n{text}".encode()).digest()
        chunk_id = chunk_id_of(
            document_id=document_id,
            version_number=version,
            strategy_id=strategy,
            ordinal=ordinal,
            heading_path=path,
            content_digest=digest,
        )
        chunks.append(Chunk(chunk_id, ordinal, path, text, digest))
    return chunks
