"""PipelineIndexer with fakes around it: load and verify, parse, reuse, embed, hand to sink."""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, cast

import numpy as np
import pytest

from services.embedding.batching import Batching
from services.embedding.tokens import TokenizerSpec
from services.index.generation import IndexGeneration
from services.indexer.chunk import Chunk
from services.indexer.pipeline.chunking import ChunkingStrategy
from services.indexer.pipeline.parsing.pool import ParsePool
from services.indexer.pipeline.version_indexer import (
    PipelineIndexer,
    chunking_strategy,
    index_generation,
)
from services.indexer.ports import StoredVersion
from services.indexer.task import ErrorCode, IndexingFailed, Lease
from services.runtime.errors import ConfigError
from services.runtime.pg.transaction import Transaction

DIMENSION = 8
TOKENIZER = TokenizerSpec(name="approx", tokenizer_file=None, max_input_tokens=128)


def lease(document_id: uuid.UUID, version: int = 1, tenant: str = "acme") -> Lease:
    return Lease(
        task_id=uuid.uuid4(),
        owner="unit",
        lease_attempt=1,
        lease_until=datetime.now(UTC),
        tenant_id=tenant,
        document_id=document_id,
        version_number=version,
        task_type="INDEX_VERSION",
        tier="standard",
        max_attempts=8,
    )


def stored(content: bytes, media_type: str = "text/markdown", **wrong: Any) -> StoredVersion:
    return StoredVersion(
        media_type=media_type,
        content=content,
        sha256=wrong.get("sha256", hashlib.sha256(content).digest()),
        size_bytes=wrong.get("size_bytes", len(content)),
    )


class Source:
    def __init__(self) -> None:
        self.versions: dict[tuple[str, uuid.UUID, int], StoredVersion] = {}

    def put(self, tenant: str, document_id: uuid.UUID, number: int, version: StoredVersion) -> None:
        self.versions[(tenant, document_id, number)] = version

    async def load(
        self, tenant_id: str, document_id: uuid.UUID, version_number: int
    ) -> StoredVersion | None:
        return self.versions.get((tenant_id, document_id, version_number))


def vector_of(text: str) -> np.ndarray:
    seed = int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big")
    return np.random.default_rng(seed).standard_normal(DIMENSION).astype(np.float32)


class RecordingEmbedder:
    """Deterministic vectors; every request's texts recorded. ``answer`` overrides replies."""

    model = "fake-model"
    dimension = DIMENSION
    tokenizer = TOKENIZER

    def __init__(self) -> None:
        self.requests: list[list[str]] = []
        self.answer: Any = None

    @property
    def texts(self) -> list[str]:
        return [text for request in self.requests for text in request]

    async def embed(self, texts: Sequence[str]) -> np.ndarray:
        self.requests.append(list(texts))
        if isinstance(self.answer, Exception):
            raise self.answer
        if self.answer is not None:
            return np.asarray(self.answer(texts))
        return np.stack([vector_of(t) for t in texts])

    async def aclose(self) -> None:
        return None


@dataclass
class MemorySink:
    """The index as a dict: what ``writer`` wrote once "committed" (the write is called)."""

    rows: dict[tuple[str, str, bytes], np.ndarray] = field(default_factory=dict)
    written: list[tuple[Lease, list[Chunk], np.ndarray]] = field(default_factory=list)

    async def known_embeddings(
        self, tenant_id: str, generation: IndexGeneration, digests: Sequence[bytes]
    ) -> dict[bytes, np.ndarray]:
        key = generation.chunking_strategy + generation.embedding_model
        return {
            d: self.rows[(tenant_id, key, d)] for d in digests if (tenant_id, key, d) in self.rows
        }

    def writer(
        self,
        lease: Lease,
        generation: IndexGeneration,
        chunks: Sequence[Chunk],
        embeddings: np.ndarray,
    ) -> Any:
        async def write(conn: Any) -> None:
            key = generation.chunking_strategy + generation.embedding_model
            for chunk, row in zip(chunks, embeddings, strict=True):
                self.rows[(lease.tenant_id, key, chunk.content_digest)] = row
            self.written.append((lease, list(chunks), embeddings))

        return write

    # The streaming path: staged slices per (task, attempt), moved in by the write.
    staged: dict[tuple[uuid.UUID, int], list[tuple[Chunk, np.ndarray]]] = field(
        default_factory=dict
    )
    stage_calls: list[tuple[int, bool]] = field(default_factory=list)

    async def stage(
        self,
        lease: Lease,
        generation: IndexGeneration,
        chunks: Sequence[Chunk],
        embeddings: np.ndarray,
        *,
        first: bool,
    ) -> None:
        assert embeddings.shape == (len(chunks), generation.dimension)
        self.stage_calls.append((len(chunks), first))
        key = (lease.task_id, lease.lease_attempt)
        self.staged.setdefault(key, []).extend(zip(chunks, embeddings, strict=True))

    async def discard_stream(self, lease: Lease) -> None:
        self.staged.pop((lease.task_id, lease.lease_attempt), None)

    def stream_writer(self, lease: Lease, generation: IndexGeneration, chunk_count: int) -> Any:
        async def write(conn: Any) -> None:
            rows = self.staged.pop((lease.task_id, lease.lease_attempt))
            assert len(rows) == chunk_count
            chunks = [chunk for chunk, _ in rows]
            await self.writer(lease, generation, chunks, np.stack([v for _, v in rows]))(conn)

        return write


@dataclass
class Harness:
    source: Source
    embedder: RecordingEmbedder
    sink: MemorySink
    indexer: PipelineIndexer

    async def index(self, the_lease: Lease) -> tuple[list[Chunk], np.ndarray]:
        outcome = await self.indexer.index(the_lease)
        assert outcome.write is not None
        # The memory sink's write ignores the transaction it is handed.
        await outcome.write(cast(Transaction, None))
        _, chunks, rows = self.sink.written[-1]
        return chunks, rows


def harness(batch_size: int = 16, max_tokens: int = 64, **streaming: Any) -> Harness:
    source, embedder, sink = Source(), RecordingEmbedder(), MemorySink()
    strategy = chunking_strategy(embedder, max_tokens=max_tokens)
    indexer = PipelineIndexer(
        source,
        ParsePool(inline=True),
        embedder,
        sink,
        strategy=strategy,
        batching=Batching(batch_size=batch_size),
        **streaming,
    )
    return Harness(source, embedder, sink, indexer)


def policy(paragraphs: int, changed: int | None = None) -> bytes:
    """A Markdown document of ``paragraphs`` sections, each about one chunk long."""
    parts = ["# Refund policy"]
    for n in range(paragraphs):
        body = f"Clause {n}: refunds for order class {n} are granted within {n % 30 + 1} days."
        if n == changed:
            body = f"Clause {n}: refunds for order class {n} are NEVER granted, sorry."
        parts.append(f"## Section {n}\n\n{body}")
    return "\n\n".join(parts).encode()


async def test_v2_with_one_paragraph_changed_embeds_only_what_changed() -> None:
    h = harness()
    document_id = uuid.uuid4()
    h.source.put("acme", document_id, 1, stored(policy(200)))
    h.source.put("acme", document_id, 2, stored(policy(200, changed=117)))

    v1_chunks, v1_rows = await h.index(lease(document_id, 1))
    assert len(v1_chunks) >= 200
    assert len(h.embedder.texts) == len(v1_chunks)
    assert all(len(r) <= 16 for r in h.embedder.requests)
    h.embedder.requests.clear()

    v2_chunks, v2_rows = await h.index(lease(document_id, 2))
    assert len(v2_chunks) == len(v1_chunks)
    assert 1 <= len(h.embedder.texts) <= 3
    assert any("NEVER" in text for text in h.embedder.texts)
    # Every row is the embedding of its own chunk, reused or fresh.
    for chunk, row in zip(v2_chunks, v2_rows, strict=True):
        assert np.array_equal(row, vector_of(chunk.embedding_input))
    unchanged = [i for i, c in enumerate(v2_chunks) if "NEVER" not in c.text]
    assert np.array_equal(v2_rows[unchanged], v1_rows[unchanged])


async def test_reuse_is_per_tenant() -> None:
    h = harness()
    document_id = uuid.uuid4()
    for tenant in ("acme", "globex"):
        h.source.put(tenant, document_id, 1, stored(policy(5)))
    await h.index(lease(document_id, 1, tenant="acme"))
    first = len(h.embedder.texts)
    await h.index(lease(document_id, 1, tenant="globex"))
    assert len(h.embedder.texts) == 2 * first


def put_repeated(h: Harness, document_id: uuid.UUID) -> uuid.UUID:
    """Two passages, each twelve times, taking turns: neighbours under one heading would
    share a chunk, these stay 24 chunks of two contents."""
    section = "## Contact\n\nWrite to support@example.com.\n\n## Hours\n\nNine to five."
    h.source.put("acme", document_id, 1, stored("\n\n".join([section] * 12).encode()))
    return document_id


async def test_identical_passages_in_one_document_are_embedded_once() -> None:
    h = harness()
    document_id = uuid.uuid4()
    chunks, rows = await h.index(lease(put_repeated(h, document_id)))
    assert len(chunks) == 24
    assert len({c.content_digest for c in chunks}) == 2
    # One request, sent shortest text first (coalescing.py).
    assert h.embedder.texts == [chunks[1].embedding_input, chunks[0].embedding_input]
    assert all(np.array_equal(row, rows[n % 2]) for n, row in enumerate(rows))


@pytest.mark.parametrize(
    ("wrong", "code"),
    [
        ({"size_bytes": 3}, ErrorCode.DOCUMENT_PARSE_FAILED),
        ({"sha256": hashlib.sha256(b"other").digest()}, ErrorCode.DOCUMENT_PARSE_FAILED),
    ],
)
async def test_stored_bytes_that_do_not_match_their_record_are_corrupt(
    wrong: dict[str, Any], code: str
) -> None:
    h = harness()
    document_id = uuid.uuid4()
    h.source.put("acme", document_id, 1, stored(b"# Refunds\n\n30 days.", **wrong))
    with pytest.raises(IndexingFailed) as raised:
        await h.indexer.index(lease(document_id))
    assert raised.value.code == code
    assert h.embedder.requests == []


async def test_a_missing_version_and_an_unknown_type_are_terminal_codes() -> None:
    h = harness()
    document_id = uuid.uuid4()
    with pytest.raises(IndexingFailed) as raised:
        await h.indexer.index(lease(document_id))
    assert raised.value.code == ErrorCode.DOCUMENT_VERSION_MISSING
    h.source.put("acme", document_id, 1, stored(b"\x89PNG", media_type="image/png"))
    with pytest.raises(IndexingFailed) as raised:
        await h.indexer.index(lease(document_id))
    assert raised.value.code == ErrorCode.UNSUPPORTED_DOCUMENT


@pytest.mark.parametrize(
    "answer",
    [
        lambda texts: np.zeros((len(texts) - 1, DIMENSION), dtype=np.float32),
        lambda texts: np.zeros((len(texts), DIMENSION + 1), dtype=np.float32),
        lambda texts: np.full((len(texts), DIMENSION), np.nan, dtype=np.float32),
    ],
    ids=["too-few-rows", "wrong-dimension", "nan"],
)
async def test_an_invalid_provider_answer_is_refused(answer: Any) -> None:
    h = harness()
    document_id = uuid.uuid4()
    h.source.put("acme", document_id, 1, stored(policy(3)))
    h.embedder.answer = answer
    with pytest.raises(IndexingFailed) as raised:
        await h.indexer.index(lease(document_id))
    assert raised.value.code == ErrorCode.EMBEDDING_RESPONSE_INVALID
    assert h.sink.written == []


async def test_a_rate_limit_reaches_the_worker_with_its_retry_after() -> None:
    h = harness()
    document_id = uuid.uuid4()
    h.source.put("acme", document_id, 1, stored(policy(3)))
    h.embedder.answer = IndexingFailed(
        ErrorCode.EMBEDDING_RATE_LIMITED, "429", retry_after_seconds=7
    )
    with pytest.raises(IndexingFailed) as raised:
        await h.indexer.index(lease(document_id))
    assert (raised.value.code, raised.value.retry_after_seconds) == (
        ErrorCode.EMBEDDING_RATE_LIMITED,
        7,
    )


def test_the_generation_names_model_dimension_and_strategy() -> None:
    embedder = RecordingEmbedder()
    strategy = chunking_strategy(embedder, max_tokens=4096)
    # Never longer than the model reads.
    assert strategy.max_tokens == TOKENIZER.max_input_tokens
    generation = index_generation(embedder, strategy)
    assert generation == IndexGeneration("fake-model", DIMENSION, strategy.strategy_id)
    assert isinstance(strategy, ChunkingStrategy)
    assert (
        harness().indexer.generation.chunking_strategy
        == chunking_strategy(embedder, max_tokens=64).strategy_id
    )


def test_chunks_leave_room_for_the_special_tokens_the_model_adds() -> None:
    embedder = RecordingEmbedder()
    embedder.tokenizer = TokenizerSpec(
        name="bert", tokenizer_file=None, max_input_tokens=256, special_tokens=2
    )
    strategy = chunking_strategy(embedder, max_tokens=256)
    # [CLS] + 254 counted tokens + [SEP] = the 256 the model reads: nothing truncated.
    assert strategy.max_tokens == 254
    assert ":max=254:" in strategy.strategy_id
    assert chunking_strategy(embedder, max_tokens=128).max_tokens == 128
    with pytest.raises(ConfigError):
        ChunkingStrategy(embedder.tokenizer, max_tokens=255)


async def test_the_loop_gets_turns_while_an_embedder_that_never_yields_works() -> None:
    """A heartbeat must run during a long embedding even when the embedder computes on
    the loop (the hashing embedder does): the pipeline gives the loop turns between waves
    of requests."""
    h = harness(batch_size=4)
    document_id = uuid.uuid4()
    h.source.put("acme", document_id, 1, stored(policy(200)))
    turns = 0
    seen: list[int] = []

    async def ticker() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    def never_yields(texts: Sequence[str]) -> np.ndarray:
        seen.append(turns)
        return np.stack([vector_of(t) for t in texts])

    h.embedder.answer = never_yields
    ticking = asyncio.create_task(ticker())
    try:
        await h.index(lease(document_id))
    finally:
        ticking.cancel()
    assert len(seen) >= 50
    # The ticker ran between waves of requests (of 8): it advanced at least once a wave.
    assert len(set(seen)) >= len(seen) // 8


async def test_a_large_document_is_staged_in_slices_and_gives_the_same_chunks_and_vectors() -> None:
    document_id = uuid.uuid4()
    content = stored(policy(120))
    held = harness()
    held.source.put("acme", document_id, 1, content)
    held_chunks, held_rows = await held.index(lease(document_id))
    assert held.sink.stage_calls == []  # small enough: held in memory, written in one go

    streamed = harness(slice_chunks=16, stream_above_chunks=40)
    streamed.source.put("acme", document_id, 1, content)
    chunks, rows = await streamed.index(lease(document_id))

    assert chunks == held_chunks
    assert np.array_equal(rows, held_rows)
    # Two slices (32 chunks) were held; the third crossed the line of 40, so what was held
    # was staged (cleaning up earlier attempts first), then every slice as it came.
    calls = streamed.sink.stage_calls
    assert calls[0] == (32, True)
    assert all(size <= 16 and not first for size, first in calls[1:])
    assert sum(size for size, _ in calls) == len(chunks)
    assert streamed.sink.staged == {}


async def test_content_repeated_across_slices_is_embedded_once() -> None:
    h = harness(slice_chunks=4, stream_above_chunks=0)
    document_id = uuid.uuid4()
    chunks, _ = await h.index(lease(put_repeated(h, document_id)))
    assert len(chunks) == 24
    assert h.embedder.texts == [chunks[1].embedding_input, chunks[0].embedding_input]


async def test_a_failed_streaming_attempt_gives_up_its_staged_rows() -> None:
    h = harness(slice_chunks=8, stream_above_chunks=8)
    document_id = uuid.uuid4()
    h.source.put("acme", document_id, 1, stored(policy(60)))
    calls = 0

    def fail_later(texts: Sequence[str]) -> np.ndarray:
        nonlocal calls
        calls += 1
        if calls > 3:
            raise IndexingFailed(ErrorCode.EMBEDDING_UNAVAILABLE, "provider down")
        return np.stack([vector_of(t) for t in texts])

    h.embedder.answer = fail_later
    with pytest.raises(IndexingFailed) as raised:
        await h.indexer.index(lease(document_id))
    assert raised.value.code == ErrorCode.EMBEDDING_UNAVAILABLE
    assert h.sink.stage_calls  # it had started staging
    assert h.sink.staged == {}
    assert h.sink.written == []
