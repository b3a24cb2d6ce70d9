"""Small plain text and Markdown skip the parse process; everything else keeps it."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest

from services.embedding.tokens import TokenizerSpec
from services.indexer.pipeline.chunking import ChunkingStrategy
from services.indexer.pipeline.parsing.pool import ParsePool
from services.runtime.indexing.index_failures import ErrorCode, IndexingFailed
from services.runtime.indexing.media_types import HTML, MARKDOWN, TEXT
from tests.support.documents import make_markdown

STRATEGY = ChunkingStrategy(TokenizerSpec("approx", None, 512))
DOCUMENT = uuid.UUID("6f2b1c7e-0d4a-4a53-9a51-1c3b0b8f5e10")


@pytest.fixture
async def pool() -> AsyncIterator[ParsePool]:
    parse_pool = ParsePool(workers=1, inline_below_bytes=4096)
    try:
        yield parse_pool
    finally:
        await parse_pool.aclose()


async def chunk_texts(pool: ParsePool, media_type: str, content: bytes) -> list[str]:
    chunks = await pool.parse_and_chunk(
        media_type, content, document_id=DOCUMENT, version_number=1, strategy=STRATEGY
    )
    return [chunk.text for chunk in chunks]


@pytest.mark.parametrize("media_type", [TEXT, MARKDOWN])
async def test_a_small_text_document_is_parsed_without_a_worker_process(
    pool: ParsePool, media_type: str
) -> None:
    content = b"# Refunds\n\nCustomers have 30 days to return an item.\n"
    assert pool.parses_inline(media_type, len(content))
    texts = await chunk_texts(pool, media_type, content)
    assert any("30 days" in text for text in texts)
    assert pool.worker_pids() == []


async def test_inline_and_worker_parses_give_the_same_chunks(pool: ParsePool) -> None:
    content = make_markdown()
    assert len(content) < 4096
    inline = await chunk_texts(pool, MARKDOWN, content)
    assert pool.worker_pids() == []
    in_worker = ParsePool(workers=1)
    try:
        assert await chunk_texts(in_worker, MARKDOWN, content) == inline
        assert in_worker.worker_pids() != []
    finally:
        await in_worker.aclose()


async def test_a_large_or_other_document_goes_to_a_worker_process(pool: ParsePool) -> None:
    large = ("A paragraph about refunds and returns. " * 120).encode()
    assert len(large) >= 4096
    assert not pool.parses_inline(TEXT, len(large))
    assert not pool.parses_inline(HTML, 100)
    await chunk_texts(pool, TEXT, large)
    assert pool.worker_pids() != []


def test_the_threshold_off_parses_nothing_inline() -> None:
    assert not ParsePool(workers=1).parses_inline(TEXT, 10)


async def test_a_small_document_that_fails_to_parse_fails_with_its_code(pool: ParsePool) -> None:
    with pytest.raises(IndexingFailed) as failed:
        await chunk_texts(pool, TEXT, b"   \n\n \t\n")
    assert failed.value.code == ErrorCode.DOCUMENT_EMPTY
    assert pool.worker_pids() == []
