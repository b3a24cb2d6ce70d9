"""Helpers for search tests: documents with versions, ACLs, chunks with known vectors and a
search pointer, written straight into the tables (as the sink would leave them), and the
composed app over the test database."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import asyncpg
import httpx
import numpy as np
from fastapi import FastAPI

from services.app import create_app
from services.embedding.hashing import HashingEmbedder
from services.embedding.port import Embedder
from services.index.ann import ann_index_name
from services.index.generation import IndexGeneration
from services.indexer.sink.pgvector import PgVectorSink
from services.publisher.settings import PublisherSettings
from services.publisher.store_pg import PgPublisherStore
from services.publisher.web.api import PublisherStores
from services.runtime.erasure.erase_pg import PgErasureStore
from services.runtime.settings import RuntimeSettings
from services.search.connections import open_search_pool
from services.search.index_pg import PgSearchIndex
from services.search.replicas import ReplicaRotation
from services.search.searcher import Generation, Searcher
from services.search.serving import GenerationSearch
from services.search.statements import SearchSettings, VectorPath
from tests.support.api import BASE_URL, UNTHROTTLED

STRATEGY = "heading-semchunk-v1:max=256:overlap=0:tok=test"


@dataclass(frozen=True)
class ChunkSpec:
    text: str
    heading_path: tuple[str, ...] = ()


async def create_ann_index(pool: asyncpg.Pool[Any], model: str, dimension: int) -> None:
    """The model's generation and partitioned HNSW index, as every indexer worker ensures
    them at start with KB_INDEXER_PARTITION_GRAPHS on."""
    await PgVectorSink(pool, partition_graphs=True).ensure_generation(
        IndexGeneration(model, dimension, STRATEGY)
    )


async def partition_graph_indexes(conn: asyncpg.Connection[Any], model: str) -> int:
    """How many of the model's partitioned HNSW index and its partitions' parts (attached
    or not) exist; the tenants' graphs (``_t...``) are not counted."""
    count: int = await conn.fetchval(
        "SELECT count(*) FROM pg_class WHERE relname = $1 OR relname LIKE $1 || '\\_p%'",
        ann_index_name(model),
    )
    return count


async def add_document(
    conn: asyncpg.Connection[Any],
    tenant_id: str,
    *,
    title: str = "Refund policy",
    read: Sequence[str] = ("group:all",),
    document_id: uuid.UUID | None = None,
) -> uuid.UUID:
    document_id = document_id or uuid.uuid4()
    await conn.execute(
        "INSERT INTO document (tenant_id, document_id, title) VALUES ($1, $2, $3)",
        tenant_id,
        document_id,
        title,
    )
    await conn.executemany(
        "INSERT INTO document_acl (tenant_id, document_id, principal, permission)"
        " VALUES ($1, $2, $3, 'READ')",
        [(tenant_id, document_id, principal) for principal in read],
    )
    return document_id


def chunk_id(document_id: uuid.UUID, version: int, ordinal: int) -> str:
    return hashlib.sha256(f"{document_id}/{version}/{ordinal}".encode()).hexdigest()


async def add_version(
    conn: asyncpg.Connection[Any],
    tenant_id: str,
    document_id: uuid.UUID,
    version: int,
    chunks: Sequence[ChunkSpec],
    embedder: HashingEmbedder,
    *,
    vectors: np.ndarray[Any, Any] | None = None,
    strategy: str = STRATEGY,
    media_type: str = "text/plain",
) -> list[str]:
    """A published version and its chunks in the index (not yet searchable: no pointer)."""
    content = "\n".join(c.text for c in chunks).encode()
    await conn.execute(
        "INSERT INTO document_version (tenant_id, document_id, version_number, content,"
        " media_type, sha256, size_bytes, status)"
        " VALUES ($1, $2, $3, $4, $7, $5, $6, 'PUBLISHED')",
        tenant_id,
        document_id,
        version,
        content,
        hashlib.sha256(content).digest(),
        len(content),
        media_type,
    )
    await conn.execute(
        "UPDATE document SET latest_version = greatest(latest_version, $3)"
        " WHERE tenant_id = $1 AND document_id = $2",
        tenant_id,
        document_id,
        version,
    )
    if vectors is None:
        vectors = embedder.embed_sync([" ".join((*c.heading_path, c.text)) for c in chunks])
    ids = [chunk_id(document_id, version, i) for i in range(len(chunks))]
    await conn.executemany(
        "INSERT INTO knowledge_chunk (tenant_id, document_id, version_number, embedding_model,"
        " chunk_id, ordinal, heading_path, text, content_digest, embedding_dimension,"
        " embedding, chunking_strategy)"
        " VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11::text::vector, $12)",
        [
            (
                tenant_id,
                document_id,
                version,
                embedder.model,
                ids[i],
                i,
                list(c.heading_path),
                c.text,
                hashlib.sha256(c.text.encode()).digest(),
                embedder.dimension,
                _vector_text(vectors[i]),
                strategy,
            )
            for i, c in enumerate(chunks)
        ],
    )
    return ids


def _vector_text(vector: Any) -> str:
    # Text form: works whether or not the connection registered pgvector's codec.
    return "[" + ",".join(repr(float(x)) for x in np.asarray(vector, dtype=np.float32)) + "]"


async def point_search_at(
    conn: asyncpg.Connection[Any],
    tenant_id: str,
    document_id: uuid.UUID,
    version: int,
    model: str,
    *,
    strategy: str = STRATEGY,
) -> None:
    """Switch the document's search pointer, as the sink's write does (with the version's
    chunk count, which search reads to choose the vector list's path)."""
    await conn.execute(
        "INSERT INTO document_search_version (tenant_id, document_id, version_number,"
        " embedding_model, chunking_strategy, chunk_count)"
        " SELECT $1, $2, $3, $4, $5, count(*)::integer FROM knowledge_chunk"
        "  WHERE tenant_id = $1 AND document_id = $2 AND version_number = $3"
        "    AND embedding_model = $4 AND chunking_strategy = $5"
        " ON CONFLICT (tenant_id, document_id) DO UPDATE"
        " SET version_number = excluded.version_number,"
        "     embedding_model = excluded.embedding_model,"
        "     chunking_strategy = excluded.chunking_strategy,"
        "     chunk_count = excluded.chunk_count,"
        "     switched_at = now()",
        tenant_id,
        document_id,
        version,
        model,
        strategy,
    )


# The threshold that makes search take a path whatever the principals may read.
EXACT_MAX_CHUNKS = {
    VectorPath.ANN: 0,
    VectorPath.EXACT: 10_000_000,
    None: SearchSettings.model_fields["search_exact_max_chunks"].default,
}


@dataclass
class SearchHarness:
    app: FastAPI
    client: httpx.AsyncClient
    pool: asyncpg.Pool[Any]
    embedder: HashingEmbedder
    searcher: Searcher

    async def search(self, tenant: Any, body: dict[str, Any]) -> httpx.Response:
        return await self.client.post(tenant.path("/search"), json=body, headers=tenant.headers)


@asynccontextmanager
async def search_harness(
    settings: RuntimeSettings,
    *,
    dimension: int = 64,
    pool_size: int = 6,
    vector_path: VectorPath | None = None,
    partition_graphs: bool = False,
) -> AsyncIterator[SearchHarness]:
    """The composed app (publisher + search) over the test's database, in-process.
    ``vector_path`` makes every vector list take that path (None: as search chooses);
    ``partition_graphs``: the model's partitioned HNSW index built first, as by indexers run
    with KB_INDEXER_PARTITION_GRAPHS on."""
    publisher_settings = PublisherSettings(
        database_url=settings.database_url,
        kafka_bootstrap_servers=settings.kafka_bootstrap_servers,
        db_pool_max_size=pool_size,
    )
    pool = await open_search_pool(publisher_settings)
    try:
        embedder = HashingEmbedder(dimension)
        if partition_graphs:
            await create_ann_index(pool, embedder.model, dimension)
        index = PgSearchIndex(
            pool,
            Generation(embedder.model, dimension),
            SearchSettings(
                database_url=settings.database_url,
                search_exact_max_chunks=EXACT_MAX_CHUNKS[vector_path],
            ),
        )
        searcher = Searcher(embedder, index)
        app = create_app(
            publisher_settings,
            stores=PublisherStores(PgPublisherStore(pool), erasure=PgErasureStore(pool)),
            searcher=searcher,
            auth_settings=UNTHROTTLED,
        )
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url=BASE_URL) as client:
            yield SearchHarness(app, client, pool, embedder, searcher)
    finally:
        await pool.close()


def generation_search_app(
    pool: asyncpg.Pool[Any],
    settings: SearchSettings,
    embedder: Embedder,
    *,
    rotation: ReplicaRotation | None = None,
    **app_options: Any,
) -> tuple[FastAPI, GenerationSearch]:
    """The composed app over ``settings.database_url``, searching it through a
    GenerationSearch of the one embedder (on the replicas of ``rotation`` if given);
    ``app_options`` go to create_app. The caller closes the search."""
    search = GenerationSearch(pool, settings, embedder, lambda g: embedder, rotation=rotation)
    app = create_app(
        PublisherSettings(database_url=settings.database_url),
        stores=PublisherStores(PgPublisherStore(pool)),
        searcher=search,
        **app_options,
    )
    return app, search
