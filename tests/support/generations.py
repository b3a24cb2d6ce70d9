"""Search generations for tests: the default an indexer registers, documents served from it,
and completions in a generation being built, written the way the sink records them (its
chunks and its document_generation_version row)."""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass
from typing import Any

import asyncpg

from services.indexer.generations.model import GenerationSpec
from services.indexer.generations.store_pg import PgGenerations
from tests.support.tasks import ensure_tenant

OLD_MODEL = "hashing-v1-3"
OLD_SETTINGS = "heading-semchunk-v1:max=256:overlap=0:tok=approx"
OLD_STRATEGY = OLD_SETTINGS + ":code=aaaa"
NEW_MODEL = "hashing-v1-4"
NEW_SETTINGS = "heading-semchunk-v1:max=200:overlap=0:tok=approx"
NEW_STRATEGY = NEW_SETTINGS + ":code=bbbb"
NEW = GenerationSpec("default", NEW_MODEL, 4, 200, 0)


@dataclass(frozen=True)
class Doc:
    tenant_id: str
    document_id: uuid.UUID


async def register_default(pool: asyncpg.Pool[Any]) -> int:
    """What an indexer's start registers: the default generation with its chunk settings."""
    generation_id: int = await pool.fetchval(
        """
        INSERT INTO search_generation (provider_profile, embedding_model, dimension,
                                       chunk_max_tokens, chunk_overlap_tokens,
                                       chunking_settings, is_default)
        VALUES ('default', $1, 3, 256, 0, $2, true)
        RETURNING generation_id
        """,
        OLD_MODEL,
        OLD_SETTINGS,
    )
    return generation_id


async def add_chunks(
    pool: asyncpg.Pool[Any],
    doc: Doc,
    version: int,
    model: str,
    strategy: str,
    dimension: int,
    count: int,
) -> None:
    vector = [0.5] * dimension
    for ordinal in range(count):
        text = f"{doc.document_id} v{version} {model} chunk {ordinal}"
        await pool.execute(
            """
            INSERT INTO knowledge_chunk (tenant_id, document_id, version_number, embedding_model,
                                         chunk_id, ordinal, heading_path, text, content_digest,
                                         embedding_dimension, embedding, chunking_strategy)
            VALUES ($1, $2, $3, $4, $5, $6, '{}', $7, $8, $9, $10, $11)
            """,
            doc.tenant_id,
            doc.document_id,
            version,
            model,
            f"{strategy}-{ordinal}",
            ordinal,
            text,
            hashlib.sha256(text.encode()).digest(),
            dimension,
            vector,
            strategy,
        )


async def add_document(
    pool: asyncpg.Pool[Any], tenant_id: str, *, served: int | None = 1, published: int = 1
) -> Doc:
    """A document with versions 1..published, served at version ``served`` from the old
    model (two chunks), or not served at all."""
    await ensure_tenant(pool, tenant_id, "standard")
    doc = Doc(tenant_id, uuid.uuid4())
    await pool.execute(
        """
        INSERT INTO document (tenant_id, document_id, title, latest_version, published_version,
                              published_at)
        VALUES ($1, $2, 'policy', $3, $3, now())
        """,
        tenant_id,
        doc.document_id,
        published,
    )
    for version in range(1, published + 1):
        content = f"{doc.document_id} v{version}".encode()
        await pool.execute(
            """
            INSERT INTO document_version (tenant_id, document_id, version_number, content,
                                          media_type, sha256, size_bytes, status, published_at)
            VALUES ($1, $2, $3, $4, 'text/plain', $5, $6, 'PUBLISHED', now())
            """,
            tenant_id,
            doc.document_id,
            version,
            content,
            hashlib.sha256(content).digest(),
            len(content),
        )
    if served is not None:
        await add_chunks(pool, doc, served, OLD_MODEL, OLD_STRATEGY, 3, 2)
        await pool.execute(
            """
            INSERT INTO document_search_version (tenant_id, document_id, version_number,
                                                 embedding_model, chunking_strategy, chunk_count)
            VALUES ($1, $2, $3, $4, $5, 2)
            """,
            tenant_id,
            doc.document_id,
            served,
            OLD_MODEL,
            OLD_STRATEGY,
        )
    return doc


async def build(
    pool: asyncpg.Pool[Any],
    doc: Doc,
    generation_id: int,
    version: int = 1,
    *,
    model: str = NEW_MODEL,
    strategy: str = NEW_STRATEGY,
    dimension: int = 4,
    chunks: int = 3,
) -> None:
    """A completion of the document's version in a generation that does not serve it."""
    await add_chunks(pool, doc, version, model, strategy, dimension, chunks)
    await pool.execute(
        """
        INSERT INTO document_generation_version (tenant_id, document_id, generation_id,
                                                 version_number, chunking_strategy, chunk_count)
        VALUES ($1, $2, $3, $4, $5, $6)
        ON CONFLICT (tenant_id, document_id, generation_id) DO UPDATE
           SET version_number = EXCLUDED.version_number,
               chunking_strategy = EXCLUDED.chunking_strategy,
               chunk_count = EXCLUDED.chunk_count
        """,
        doc.tenant_id,
        doc.document_id,
        generation_id,
        version,
        strategy,
        chunks,
    )


async def one_row(pool: asyncpg.Pool[Any], sql: str, *args: Any) -> dict[str, Any]:
    row = await pool.fetchrow(sql, *args)
    assert row is not None
    return dict(row)


async def pointers(pool: asyncpg.Pool[Any], tenant_id: str) -> dict[uuid.UUID, tuple[Any, ...]]:
    rows = await pool.fetch(
        """
        SELECT document_id, version_number, embedding_model, chunking_strategy, chunk_count
          FROM document_search_version WHERE tenant_id = $1
        """,
        tenant_id,
    )
    return {r["document_id"]: tuple(r.values())[1:] for r in rows}


async def tenant_rows(pool: asyncpg.Pool[Any]) -> set[tuple[str, int, bool]]:
    rows = await pool.fetch(
        "SELECT tenant_id, generation_id, serving FROM tenant_search_generation"
    )
    return {(r["tenant_id"], r["generation_id"], r["serving"]) for r in rows}


async def new_generation(pool: asyncpg.Pool[Any], tenants: list[str]) -> int:
    outcome = await PgGenerations(pool).create(NEW, tenants, max_attempts=8)
    # What the first indexer to build it records.
    await pool.execute(
        "UPDATE search_generation SET chunking_settings = $2 WHERE generation_id = $1",
        outcome.generation.generation_id,
        NEW_SETTINGS,
    )
    return outcome.generation.generation_id
