"""Indexing and searching a quality set the way the product does.

Documents go through the real parser (``parse_document``), the real chunker with the
indexer's default strategy (``chunk_sections``, 256 tokens, the model's tokenizer) and the
configured embedder (default: the offline int8 all-MiniLM-L6-v2), and are written to the
index tables of a database of the bench's own; queries go through ``Searcher`` on
``PgSearchIndex`` (the production search statement, RRF for hybrid). What is skipped is the
queue and the sink's fenced transaction, which do not change what is searched.

Chunk embeddings are cached on disk by (model, sha256 of the embedding input), so a re-run
(e.g. after a change to keyword search) does not embed again; ``--no-cache`` turns it off.
"""

from __future__ import annotations

import hashlib
import os
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import numpy as np

from bench.quality_examples import SourceDocument
from bench.search_data import PublishedRows, chunk_row
from services.embedding.batching import embed_batched
from services.embedding.port import Embedder, Vectors
from services.embedding.tokens import TokenizerSpec, load_token_counter
from services.indexer.chunk import Chunk
from services.indexer.pipeline.chunking import chunk_sections
from services.indexer.pipeline.parsing import parse_document
from services.indexer.pipeline.version_indexer import chunking_strategy
from services.indexer.settings import IndexerSettings

PRINCIPAL = "group:all"
EMBED_BATCH = 32


@dataclass
class IndexedSet:
    """The chunks of a set, and which unit each chunk is judged as."""

    strategy_id: str
    chunks: dict[str, list[Chunk]]  # doc_key -> chunks
    unit_of_chunk: dict[tuple[uuid.UUID, str], str] = field(default_factory=dict)
    document_ids: dict[str, uuid.UUID] = field(default_factory=dict)
    vectors: dict[str, Vectors] = field(default_factory=dict)  # doc_key -> rows
    chunk_count: int = 0
    embedded: int = 0  # chunks sent to the model (the rest came from the cache)


def document_uuid(doc_key: str) -> uuid.UUID:
    return uuid.UUID(bytes=hashlib.sha256(doc_key.encode()).digest()[:16])


def chunk_documents(
    documents: Sequence[SourceDocument],
    embedder: Embedder,
    unit_of: Callable[[str, tuple[str, ...]], str],
) -> IndexedSet:
    default_max = IndexerSettings.model_fields["indexer_chunk_max_tokens"].default
    strategy = chunking_strategy(embedder, max_tokens=default_max)
    count = load_token_counter(strategy.tokenizer)
    indexed = IndexedSet(strategy.strategy_id, {})
    for doc in documents:
        document_id = document_uuid(doc.doc_key)
        chunks = chunk_sections(
            parse_document(doc.media_type, doc.content),
            document_id=document_id,
            version_number=1,
            strategy=strategy,
            count_tokens=count,
        )
        indexed.chunks[doc.doc_key] = chunks
        indexed.document_ids[doc.doc_key] = document_id
        for chunk in chunks:
            indexed.unit_of_chunk[(document_id, chunk.chunk_id)] = unit_of(
                doc.doc_key, chunk.heading_path
            )
        indexed.chunk_count += len(chunks)
    return indexed


class EmbeddingCache:
    def __init__(self, model: str, enabled: bool = True) -> None:
        base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in model)
        self._path = base / "kb-pipeline-bench" / f"embeddings-{safe}.npz"
        self._enabled = enabled
        self._known: dict[bytes, Vectors] = {}
        if enabled and self._path.exists():
            with np.load(self._path) as data:
                for key, row in zip(data["keys"], data["vectors"], strict=True):
                    digest = key.tobytes()
                    if len(digest) == 32:  # anything else is not a cache entry of ours
                        self._known[digest] = row

    @staticmethod
    def key(text: str) -> bytes:
        return hashlib.sha256(text.encode()).digest()

    def get(self, text: str) -> Vectors | None:
        return self._known.get(self.key(text))

    def put(self, text: str, vector: Vectors) -> None:
        self._known[self.key(text)] = vector

    def save(self) -> None:
        if not self._enabled or not self._known:
            return
        self._path.parent.mkdir(parents=True, exist_ok=True)
        # Raw digests as rows of bytes (an "S32" array would strip trailing NUL bytes).
        keys = np.frombuffer(b"".join(self._known), dtype=np.uint8).reshape(-1, 32)
        vectors = np.stack(list(self._known.values())).astype(np.float32)
        tmp = self._path.with_suffix(".tmp.npz")
        np.savez(tmp, keys=keys, vectors=vectors)
        tmp.replace(self._path)


async def embed_texts(embedder: Embedder, texts: Sequence[str], cache: EmbeddingCache) -> Vectors:
    """Rows in order; only texts the cache does not hold go to the model."""
    out = np.empty((len(texts), embedder.dimension), dtype=np.float32)
    missing = []
    for i, text in enumerate(texts):
        known = cache.get(text)
        if known is None:
            missing.append(i)
        else:
            out[i] = known
    if missing:
        fresh = await embed_batched(embedder, [texts[i] for i in missing], batch_size=EMBED_BATCH)
        for row, i in enumerate(missing):
            out[i] = fresh[row]
            cache.put(texts[i], fresh[row])
    return out


async def embed_set(indexed: IndexedSet, embedder: Embedder, cache: EmbeddingCache) -> None:
    keys = list(indexed.chunks)
    inputs = [c.embedding_input for key in keys for c in indexed.chunks[key]]
    before = sum(cache.get(t) is None for t in inputs)
    vectors = await embed_texts(embedder, inputs, cache)
    indexed.embedded = before
    start = 0
    for key in keys:
        n = len(indexed.chunks[key])
        indexed.vectors[key] = vectors[start : start + n]
        start += n


async def load_tenant(
    conn: asyncpg.Connection[Any],
    tenant: str,
    text_search_config: str,
    documents: Sequence[SourceDocument],
    indexed: IndexedSet,
    model: str,
) -> None:
    """One tenant holding the set, every document at version 1 and readable by PRINCIPAL."""
    await conn.execute(
        "INSERT INTO tenant (tenant_id, tier, text_search_config)"
        " VALUES ($1, 'standard', $2::regconfig)",
        tenant,
        text_search_config,
    )
    rows = PublishedRows(model, indexed.strategy_id)
    for doc in documents:
        document_id = indexed.document_ids[doc.doc_key]
        rows.add_document(
            tenant, document_id, doc.title, doc.content, [PRINCIPAL], media_type=doc.media_type
        )
        vectors = indexed.vectors[doc.doc_key]
        for chunk, vector in zip(indexed.chunks[doc.doc_key], vectors, strict=True):
            rows.chunks.append(
                chunk_row(
                    tenant,
                    document_id,
                    model,
                    indexed.strategy_id,
                    chunk.chunk_id,
                    chunk.ordinal,
                    chunk.heading_path,
                    chunk.text,
                    vector,
                    digest=chunk.content_digest,
                )
            )
    async with conn.transaction():
        await rows.copy(conn)


class QueryEmbedder:
    """The configured embedder with the set's queries embedded up front, each on its own as
    a search embeds it: the Searcher then finds every query's vector without a model run
    per mode and tenant."""

    def __init__(self, inner: Embedder, vectors: dict[str, Vectors]) -> None:
        self._inner = inner
        self._vectors = vectors

    @classmethod
    async def prepared(
        cls, inner: Embedder, queries: Sequence[str], cache: EmbeddingCache
    ) -> QueryEmbedder:
        vectors: dict[str, Vectors] = {}
        for query in sorted(set(queries)):
            key = "query:" + query
            known = cache.get(key)
            if known is None:
                known = (await inner.embed([query]))[0]
                cache.put(key, known)
            vectors[query] = known
        return cls(inner, vectors)

    @property
    def model(self) -> str:
        return self._inner.model

    @property
    def dimension(self) -> int:
        return self._inner.dimension

    @property
    def tokenizer(self) -> TokenizerSpec:
        return self._inner.tokenizer

    async def embed(self, texts: Sequence[str]) -> Vectors:
        return np.stack([self._vectors[t] for t in texts])

    async def aclose(self) -> None:
        return None


def timed() -> Callable[[], float]:
    start = time.perf_counter()
    return lambda: time.perf_counter() - start
