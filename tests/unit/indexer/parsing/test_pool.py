"""The parse pool keeps CPU-bound parsing off the event loop and survives bad documents.

These tests start real worker processes (forkserver), so they take a few seconds."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from services.embedding.tokens import TokenizerSpec, approximate_tokens
from services.indexer.pipeline.chunking import ChunkingStrategy, chunk_sections
from services.indexer.pipeline.parsing import ParseLimits, parse_document
from services.indexer.pipeline.parsing.pool import ParsePool
from services.indexer.task import ErrorCode, IndexingFailed
from services.runtime.indexing.media_types import DOCX, MARKDOWN, PDF
from tests.support.documents import (
    SAMPLE,
    make_docx,
    make_docx_swelling,
    make_large_pdf,
    make_markdown,
    make_scanned_pdf,
)

STRATEGY = ChunkingStrategy(TokenizerSpec("approx", None, 512))
DOCUMENT = uuid.UUID("0b9d7a3e-58c3-4c1b-a8a5-3f8f7e0c1d22")


@pytest.fixture(scope="module")
def big_pdf() -> bytes:
    return make_large_pdf(pages=40)


@pytest.fixture(scope="module")
async def pool() -> AsyncIterator[ParsePool]:
    # One pool for the module, as a worker has one: the tests also show it survives them.
    parse_pool = ParsePool(workers=1)
    try:
        yield parse_pool
    finally:
        await parse_pool.aclose()


async def parse(pool: ParsePool, media_type: str, content: bytes, **kwargs: float) -> int:
    chunks = await pool.parse_and_chunk(
        media_type, content, document_id=DOCUMENT, version_number=1, strategy=STRATEGY, **kwargs
    )
    return len(chunks)


class Ticker:
    """Counts ticks of the event loop while something else runs; ``ticked`` is set once
    ``enough`` ticks happened."""

    def __init__(self, enough: int) -> None:
        self.ticks = 0
        self.enough = enough
        self.ticked = asyncio.Event()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(0.001)
            self.ticks += 1
            if self.ticks >= self.enough:
                self.ticked.set()


async def ticks_during(job: asyncio.Task[int], enough: int = 20) -> bool:
    """Whether the loop ticked ``enough`` times before ``job`` finished."""
    ticker = Ticker(enough)
    ticking = asyncio.create_task(ticker.run())
    ticked = asyncio.create_task(ticker.ticked.wait())
    try:
        waiting: set[asyncio.Future[Any]] = {job, ticked}
        done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        await job
        return ticked in done and job not in done
    finally:
        ticking.cancel()
        ticked.cancel()


async def test_the_result_is_what_parsing_and_chunking_give_in_process(pool: ParsePool) -> None:
    content = make_markdown()
    chunks = await pool.parse_and_chunk(
        MARKDOWN, content, document_id=DOCUMENT, version_number=3, strategy=STRATEGY
    )
    assert chunks == chunk_sections(
        parse_document(MARKDOWN, content),
        document_id=DOCUMENT,
        version_number=3,
        strategy=STRATEGY,
        count_tokens=approximate_tokens,
    )


async def test_the_event_loop_keeps_ticking_while_a_big_pdf_is_parsed(
    pool: ParsePool, big_pdf: bytes
) -> None:
    await parse(pool, MARKDOWN, make_markdown())  # the worker is up
    job = asyncio.ensure_future(parse(pool, PDF, big_pdf))
    assert await ticks_during(job)
    assert job.result() > 40


async def test_the_ticker_notices_a_blocked_loop(big_pdf: bytes) -> None:
    # The check above can fail: parsing on the loop itself starves the ticker.
    async def on_the_loop() -> int:
        return len(parse_document(PDF, big_pdf))

    job = asyncio.ensure_future(on_the_loop())
    assert not await ticks_during(job)


async def test_a_failure_in_the_worker_arrives_with_its_code(pool: ParsePool) -> None:
    with pytest.raises(IndexingFailed) as failed:
        await parse(pool, PDF, make_scanned_pdf())
    assert failed.value.code == ErrorCode.DOCUMENT_EMPTY


async def test_over_budget_the_worker_is_replaced_and_the_pool_goes_on(
    pool: ParsePool, big_pdf: bytes
) -> None:
    await parse(pool, MARKDOWN, make_markdown())
    (before,) = pool.worker_pids()
    restarts = pool.restarts
    with pytest.raises(IndexingFailed) as failed:
        await parse(pool, PDF, big_pdf, budget_seconds=0.01)
    assert failed.value.code == ErrorCode.DOCUMENT_PARSE_TIMEOUT
    assert pool.restarts == restarts + 1
    assert await parse(pool, MARKDOWN, make_markdown()) == 6
    assert pool.worker_pids() != [before]


@pytest.mark.parametrize(
    ("signal_number", "code"),
    [
        # Killed as the kernel's out-of-memory killer kills: the document was too large.
        (signal.SIGKILL, ErrorCode.DOCUMENT_TOO_LARGE),
        # Any other death: the parse failed.
        (signal.SIGTERM, ErrorCode.DOCUMENT_PARSE_FAILED),
    ],
)
async def test_a_worker_that_dies_fails_the_document_and_is_replaced(
    pool: ParsePool, big_pdf: bytes, signal_number: int, code: str
) -> None:
    await parse(pool, MARKDOWN, make_markdown())
    (pid,) = pool.worker_pids()
    restarts = pool.restarts
    job = asyncio.ensure_future(parse(pool, PDF, big_pdf))
    await asyncio.sleep(0)  # the job is submitted
    os.kill(pid, signal_number)
    with pytest.raises(IndexingFailed) as failed:
        await job
    assert failed.value.code == code
    if code == ErrorCode.DOCUMENT_TOO_LARGE:
        assert "KB_INDEXER_PARSE_MEMORY_LIMIT_BYTES" in failed.value.message
    assert await parse(pool, MARKDOWN, make_markdown()) == 6
    assert pool.restarts == restarts + 1


def address_space(pid: int) -> tuple[int, int | None]:
    """A process's address space now (bytes) and its limit (None: unlimited)."""
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        size = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
    with open(f"/proc/{pid}/limits", encoding="ascii") as limits:
        soft = next(line.split()[3] for line in limits if line.startswith("Max address space"))
    return size, None if soft == "unlimited" else int(soft)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc")
async def test_each_worker_caps_its_address_space(pool: ParsePool) -> None:
    await parse(pool, MARKDOWN, make_markdown())
    (pid,) = pool.worker_pids()
    assert address_space(pid)[1] == pool.limits.memory_limit_bytes
    unlimited = ParsePool(workers=1, limits=ParseLimits(memory_limit_bytes=0))
    try:
        await parse(unlimited, MARKDOWN, make_markdown())
        (pid,) = unlimited.worker_pids()
        assert address_space(pid)[1] is None
    finally:
        await unlimited.aclose()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc")
async def test_a_parse_past_the_address_space_limit_is_too_large_and_the_pool_goes_on(
    pool: ParsePool,
) -> None:
    # A worker's own size here, plus room for an ordinary document, not for the DOCX whose
    # XML part takes some 20x its 48 MB to open.
    await parse(pool, MARKDOWN, make_markdown())
    (pid,) = pool.worker_pids()
    size, _ = address_space(pid)
    limit = size + 256 * 1024 * 1024
    tight = ParsePool(workers=1, limits=ParseLimits(memory_limit_bytes=limit))
    try:
        await parse(tight, MARKDOWN, make_markdown())
        with pytest.raises(IndexingFailed) as failed:
            await parse(tight, DOCX, make_docx_swelling())
        assert failed.value.code == ErrorCode.DOCUMENT_TOO_LARGE
        assert f"KB_INDEXER_PARSE_MEMORY_LIMIT_BYTES = {limit}" in failed.value.message
        # The swollen process was replaced; the next document parses in a fresh one.
        assert tight.restarts == 1
        assert await parse(tight, MARKDOWN, make_markdown()) == 6
        assert await parse(tight, DOCX, make_docx(SAMPLE[:2])) > 0
    finally:
        await tight.aclose()


async def test_inline_mode_runs_in_a_thread_with_the_same_results() -> None:
    inline = ParsePool(inline=True, limits=ParseLimits(budget_seconds=60))
    try:
        assert await parse(inline, MARKDOWN, make_markdown()) == 6
        with pytest.raises(IndexingFailed) as failed:
            await parse(inline, PDF, make_scanned_pdf())
        assert failed.value.code == ErrorCode.DOCUMENT_EMPTY
    finally:
        await inline.aclose()


async def test_a_closed_pool_refuses_work() -> None:
    closed = ParsePool(inline=True)
    await closed.aclose()
    with pytest.raises(RuntimeError):
        await parse(closed, MARKDOWN, make_markdown())


async def process_exit(pid: int) -> None:
    """Returns once process ``pid`` (not our child: the forkserver's) has exited."""
    exited = asyncio.Event()
    loop = asyncio.get_running_loop()
    try:
        descriptor = os.pidfd_open(pid)
    except ProcessLookupError:
        return  # gone already
    loop.add_reader(descriptor, exited.set)
    try:
        await exited.wait()
    finally:
        loop.remove_reader(descriptor)
        os.close(descriptor)


async def test_a_worker_that_died_while_idle_is_replaced_before_the_next_document(
    pool: ParsePool,
) -> None:
    await parse(pool, MARKDOWN, make_markdown())
    (pid,) = pool.worker_pids()
    restarts = pool.restarts
    os.kill(pid, signal.SIGKILL)
    await process_exit(pid)
    assert await parse(pool, MARKDOWN, make_markdown()) == 6
    assert pool.restarts == restarts + 1


async def test_a_cancelled_parse_stops_its_worker(pool: ParsePool, big_pdf: bytes) -> None:
    await parse(pool, MARKDOWN, make_markdown())
    (pid,) = pool.worker_pids()
    job = asyncio.ensure_future(parse(pool, PDF, big_pdf))
    await asyncio.sleep(0)  # the job is submitted
    job.cancel()
    with pytest.raises(asyncio.CancelledError):
        await job
    await process_exit(pid)
    assert await parse(pool, MARKDOWN, make_markdown()) == 6


async def test_an_overrun_in_one_slot_leaves_the_other_slot_parsing(big_pdf: bytes) -> None:
    two = ParsePool(workers=2)
    try:
        # Both workers up, so the overrun's budget starts while the other is still parsing.
        await asyncio.gather(*(parse(two, MARKDOWN, make_markdown()) for _ in range(2)))
        assert len(two.worker_pids()) == 2
        slow = asyncio.ensure_future(parse(two, PDF, big_pdf))
        overrun = asyncio.ensure_future(parse(two, PDF, big_pdf, budget_seconds=0.01))
        with pytest.raises(IndexingFailed) as failed:
            await overrun
        assert failed.value.code == ErrorCode.DOCUMENT_PARSE_TIMEOUT
        assert not slow.done()
        assert await slow > 40
        assert two.restarts == 1
    finally:
        await two.aclose()


async def test_slices_stream_in_order_and_a_consumer_failure_is_its_own(
    pool: ParsePool, big_pdf: bytes
) -> None:
    from services.indexer.pipeline.parsing.stream import DocumentBytes

    content = make_markdown()
    whole = chunk_sections(
        parse_document(MARKDOWN, content),
        document_id=DOCUMENT,
        version_number=1,
        strategy=STRATEGY,
        count_tokens=approximate_tokens,
    )
    slices: list[list[Any]] = []

    async def take(part: list[Any]) -> None:
        slices.append(part)

    count = await pool.stream_chunks(
        MARKDOWN,
        DocumentBytes(content),
        document_id=DOCUMENT,
        version_number=1,
        strategy=STRATEGY,
        on_slice=take,
        slice_chunks=2,
    )
    assert count == len(whole)
    assert [chunk for part in slices for chunk in part] == whole
    assert all(len(part) <= 2 for part in slices)

    # A consumer that fails mid-document (here a network error of its own) gets its own
    # error back, not a parse failure; the worker, mid-document, is replaced.
    restarts = pool.restarts

    async def fail(part: list[Any]) -> None:
        raise ConnectionResetError("the database went away")

    with pytest.raises(ConnectionResetError):
        await pool.stream_chunks(
            PDF,
            DocumentBytes(big_pdf),
            document_id=DOCUMENT,
            version_number=1,
            strategy=STRATEGY,
            on_slice=fail,
            slice_chunks=2,
        )
    assert pool.restarts == restarts + 1
    assert await parse(pool, MARKDOWN, content) == len(whole)
