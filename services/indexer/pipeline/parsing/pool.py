"""Parsing and chunking off the event loop, in worker processes, under a time budget.

Parsing is CPU-bound and some documents are pathological, so it runs in separate
processes: the event loop (heartbeats, Kafka, other tasks) never waits for it, and a
document that runs past its budget or takes its process down costs only that process.

Each worker is a slot of its own (a one-process executor), so killing an overrunning
process never disturbs another document being parsed at the same time, and a process
that dies was unambiguously working on this document. Processes come from a forkserver
(a fork of a small single-threaded server, not of this threaded process) and stay up
between documents, keeping their tokenizer.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import multiprocessing
import os
import select
import signal
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Final

from services.indexer.chunk import Chunk
from services.indexer.pipeline.chunking import ChunkingStrategy
from services.indexer.pipeline.parsing import ParseLimits
from services.indexer.pipeline.parsing.limits import NEAR_LIMIT, peak_address_space
from services.indexer.pipeline.parsing.stream import (
    DEFAULT_SLICE_CHUNKS,
    DocumentBytes,
    Message,
    OnSlice,
    Overrun,
    Reported,
    WorkerGone,
    attach,
    chunk_slices,
    consume,
    receive,
    send,
    stream_in_worker,
)
from services.indexer.task import ErrorCode, IndexingFailed
from services.runtime.indexing import media_types
from services.runtime.logging import get_logger
from services.runtime.native_memory import release_freed_memory

log = get_logger(__name__)

_START_METHOD: Final = "forkserver"
_INLINE_MEDIA_TYPES: Final = frozenset({media_types.TEXT, media_types.MARKDOWN})
_DEFAULT_LIMITS: Final = ParseLimits()
_PRELOAD: Final = (
    "services.indexer.pipeline.parsing.pool",
    "services.indexer.pipeline.parsing.stream",
    # The parsers are imported at first use (parsing/__init__.py): here, before any budget.
    "services.indexer.pipeline.parsing.text",
    "services.indexer.pipeline.parsing.markdown",
    "services.indexer.pipeline.parsing.html",
    "services.indexer.pipeline.parsing.pdf",
    "services.indexer.pipeline.parsing.docx",
    "tokenizers",
)


def _warm_up() -> None:
    """Imports the parsers in a fresh process (if its forkserver had not) before a
    document's budget starts."""
    for module in _PRELOAD:
        importlib.import_module(module)


def _exited(process: Any) -> bool:
    """Whether a worker process has ended. A forkserver reports a child's exit only after
    reaping it, so the process itself is asked too (a pidfd is readable once it exits)."""
    if not process.is_alive():
        return True
    try:
        descriptor = os.pidfd_open(process.pid)
    except ProcessLookupError:
        return True
    except (AttributeError, OSError):  # no pidfds here: rely on the forkserver's report
        return False
    try:
        readable, _, _ = select.select([descriptor], [], [], 0)
        return bool(readable)
    finally:
        os.close(descriptor)


_MEMORY_KILL: Final = int(signal.SIGKILL)
_EXIT_WAIT_SECONDS: Final = 10.0


def _exit_signals(processes: list[Any]) -> list[int]:
    """The signals that ended these (exited) worker processes. It waits for the forkserver
    to report each exit status: on a loaded machine that report can take seconds, and a
    status missed here would call an out-of-memory kill an ordinary parse failure."""
    signals: list[int] = []
    for process in processes:
        with contextlib.suppress(Exception):
            process.join(_EXIT_WAIT_SECONDS)
        code = process.exitcode
        if code is not None and code < 0:
            signals.append(-code)
    return signals


@dataclass
class _Slot:
    executor: ProcessPoolExecutor
    # This process's end of the slot's pipe: the document goes out, its slices come back.
    channel: Connection
    # The worker's end, until its process has been started with it (then closed here, so
    # a worker that dies is an end of file, not a wait forever).
    worker_end: Connection | None
    # Set by the slot's first use: starting a process (and the forkserver) blocks.
    warm: Future[None] | None = None


# What ``stream_in_worker`` is given besides the bytes: media type, document id, version,
# strategy, limits, chunks per slice.
_ParseArgs = tuple[str, uuid.UUID, int, ChunkingStrategy, ParseLimits, int]


@dataclass(frozen=True)
class _Parse:
    """One document to parse and chunk: its bytes, the rest of the job, and where its
    slices go."""

    content: DocumentBytes
    args: _ParseArgs
    on_slice: OnSlice

    def messages(self) -> Iterator[Message]:
        """Parsed and chunked in this process: the messages a worker would send."""
        media_type, document_id, version_number, strategy, limits, slice_chunks = self.args
        return chunk_slices(
            media_type,
            self.content.take(),
            document_id,
            version_number,
            strategy,
            limits,
            slice_chunks,
        )


class ParsePool:
    """``workers`` processes parsing and chunking one document each; callers beyond that
    wait for a free one (the wait is not part of a document's budget)."""

    def __init__(
        self,
        *,
        workers: int = 1,
        limits: ParseLimits = _DEFAULT_LIMITS,
        inline: bool = False,
        inline_below_bytes: int = 0,
    ) -> None:
        if workers < 1 or inline_below_bytes < 0:
            raise ValueError("a parse pool needs at least one worker, and a size >= 0")
        self._limits = limits
        self._inline = inline
        self._inline_below = inline_below_bytes
        self._context = multiprocessing.get_context(_START_METHOD)
        if not inline:
            # The forkserver imports the parsers once; every worker, and every replacement
            # after a kill, is forked from it ready to parse. (The setting is the process's;
            # it only applies if no forkserver is running yet.)
            self._context.set_forkserver_preload(list(_PRELOAD))
        self._slots: list[_Slot] = [] if inline else [self._new_slot() for _ in range(workers)]
        self._free: asyncio.Queue[int] = asyncio.Queue()
        for index in range(len(self._slots)):
            self._free.put_nowait(index)
        self._closed = False
        # How often a worker process was replaced (overrun, death, cancellation).
        self.restarts = 0

    @property
    def limits(self) -> ParseLimits:
        return self._limits

    def worker_pids(self) -> list[int]:
        """The live worker processes (for operators and tests)."""
        return [
            process.pid
            for slot in self._slots
            for process in self._processes(slot)
            if process.is_alive()
        ]

    async def stream_chunks(
        self,
        media_type: str,
        content: DocumentBytes,
        *,
        document_id: uuid.UUID,
        version_number: int,
        strategy: ChunkingStrategy,
        on_slice: OnSlice,
        slice_chunks: int = DEFAULT_SLICE_CHUNKS,
        budget_seconds: float | None = None,
    ) -> int:
        """Parses and chunks the document, awaiting ``on_slice`` with each slice of at most
        ``slice_chunks`` chunks in document order; returns the chunk count. The worker waits
        while ``on_slice`` runs, so neither side holds more than a slice or two.

        Raises ``IndexingFailed``: the parse codes, DOCUMENT_PARSE_TIMEOUT when parsing
        outruns the budget (``ParseLimits.budget_seconds`` unless given; time spent in
        ``on_slice`` is not counted), DOCUMENT_TOO_LARGE if the worker ran out of memory
        (a MemoryError past its address-space limit, or killed by SIGKILL as the kernel's
        out-of-memory killer does), DOCUMENT_PARSE_FAILED if it died otherwise.
        Whatever ``on_slice`` raises ends the parse and is raised here."""
        if self._closed:
            raise RuntimeError("the parse pool is closed")
        if slice_chunks < 1:
            raise ValueError("slice_chunks must be >= 1")
        budget = self._limits.budget_seconds if budget_seconds is None else budget_seconds
        args = (media_type, document_id, version_number, strategy, self._limits, slice_chunks)
        parse = _Parse(content, args, on_slice)
        if self.parses_inline(media_type, content.size):
            return await self._stream_on_loop(parse)
        if self._inline:
            return await self._stream_inline(parse, budget)
        return await self._stream_in_slot(parse, budget)

    def parses_inline(self, media_type: str, size_bytes: int) -> bool:
        """Small plain text and Markdown are parsed in this process, on the event loop: their
        parse takes less time than the round trip to a worker, and their parsers (a
        decode, a Markdown tokenizer) neither hang nor blow up memory the way a PDF or a
        DOCX can, which is what the worker processes' budget and isolation are for."""
        return media_type in _INLINE_MEDIA_TYPES and size_bytes < self._inline_below

    async def parse_and_chunk(
        self,
        media_type: str,
        content: bytes,
        *,
        document_id: uuid.UUID,
        version_number: int,
        strategy: ChunkingStrategy,
        budget_seconds: float | None = None,
    ) -> list[Chunk]:
        """All the document's chunks at once (small documents, tests, benchmarks); raises
        as ``stream_chunks`` does."""
        chunks: list[Chunk] = []

        async def collect(part: list[Chunk]) -> None:
            chunks.extend(part)

        await self.stream_chunks(
            media_type,
            DocumentBytes(content),
            document_id=document_id,
            version_number=version_number,
            strategy=strategy,
            on_slice=collect,
            budget_seconds=budget_seconds,
        )
        return chunks

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        # A document still being parsed finishes or runs into its budget (its caller
        # kills the process then); joining the processes blocks, so it happens off the loop.
        await asyncio.gather(
            *(asyncio.to_thread(slot.executor.shutdown, wait=True) for slot in self._slots)
        )
        for slot in self._slots:
            self._close_channel(slot)

    # -- running ---------------------------------------------------------------------------

    @staticmethod
    async def _stream_on_loop(parse: _Parse) -> int:
        """A small text parsed and chunked right here, between two awaits: a thread's hop
        and its wake-up of the loop cost more than the parse."""
        count = 0
        for kind, body in parse.messages():
            if kind == "chunks":
                count += len(body)
                await parse.on_slice(body)
            elif kind == "failed":
                code, message = body
                raise IndexingFailed(code, message)
        return count

    async def _stream_inline(self, parse: _Parse, budget: float) -> int:
        # A thread cannot be stopped: past the budget the caller moves on and the thread
        # finishes its step on its own. Inline mode is for tests.
        messages = parse.messages()

        async def next_message() -> Message:
            return await asyncio.to_thread(next, messages)

        try:
            return await consume(next_message, budget, parse.on_slice)
        except Reported as reported:
            raise reported.failure from None
        except Overrun:
            raise self._timeout(budget) from None

    async def _stream_in_slot(self, parse: _Parse, budget: float) -> int:
        index = await self._free.get()
        processes: list[Any] = []
        try:
            try:
                slot, job = await self._submit(index, parse.args)
                # Held to read its exit status should it die (the executor forgets it).
                processes = self._processes(slot)
                # Sent, not pickled with the job: the executor keeps a job's arguments
                # until it finishes, and this process must not hold the bytes that long.
                await asyncio.to_thread(send, slot.channel, parse.content.take())
                # Loading them cost a few copies' worth of freed pages: back they go.
                release_freed_memory()

                async def next_message() -> Message:
                    return await asyncio.to_thread(receive, slot.channel, job)

                count = await consume(next_message, budget, parse.on_slice)
                await asyncio.wrap_future(job)
                self._replace_if_swollen(index, processes)
                return count
            except Reported as reported:
                # The worker is done with the document and finishes its job: nothing to kill.
                await asyncio.wrap_future(job)
                self._replace_if_swollen(index, processes)
                raise reported.failure from None
            except Overrun:
                self._restart(index, reason="budget")
                raise self._timeout(budget) from None
            except WorkerGone:
                signals = await asyncio.to_thread(_exit_signals, processes)
                self._restart(index, reason="killed" if _MEMORY_KILL in signals else "died")
                raise self._death(signals) from None
            except BaseException:
                # Cancelled, or the consumer failed: the worker is mid-document and nobody
                # wants the rest; do not let the slot keep parsing it.
                self._restart(index, reason="abandoned")
                raise
        finally:
            if not self._closed:
                self._free.put_nowait(index)

    async def _submit(self, index: int, args: _ParseArgs) -> tuple[_Slot, Future[None]]:
        for attempt in range(2):
            slot = self._slots[index]
            if slot.warm is None:
                slot.warm = await asyncio.to_thread(slot.executor.submit, _warm_up)
                # The submit started the worker with its end of the pipe: ours goes.
                if slot.worker_end is not None:
                    slot.worker_end.close()
                    slot.worker_end = None
            if not slot.warm.done():
                # A fresh process imports the parsers first, outside any document's budget.
                with contextlib.suppress(Exception):
                    await asyncio.wrap_future(slot.warm)
            if attempt == 0 and not self._alive(slot):
                # It died while idle (or starting): not this document's doing.
                self._restart(index, reason="died_idle")
                continue
            break
        return slot, slot.executor.submit(stream_in_worker, *args)

    @staticmethod
    def _processes(slot: _Slot) -> list[Any]:
        # ProcessPoolExecutor has no public way to see or stop its processes before
        # Python 3.14 (terminate_workers); its process table is the only handle.
        return list(dict(getattr(slot.executor, "_processes", None) or {}).values())

    def _alive(self, slot: _Slot) -> bool:
        return not any(_exited(process) for process in self._processes(slot))

    def _death(self, signals: list[int]) -> IndexingFailed:
        """What a parse process's death says about the document. SIGKILL is how the kernel
        ends a process it picks when memory runs out (the machine's or a cgroup's); past
        the address-space limit an allocation fails, which is a MemoryError reported
        as such, or native code aborting the process."""
        limit = self._limits.memory_limit_bytes
        if _MEMORY_KILL in signals:
            return IndexingFailed(
                ErrorCode.DOCUMENT_TOO_LARGE,
                "the parsing process was killed (SIGKILL: out of memory) on this document"
                + (f" (KB_INDEXER_PARSE_MEMORY_LIMIT_BYTES = {limit})" if limit > 0 else ""),
            )
        return IndexingFailed(
            ErrorCode.DOCUMENT_PARSE_FAILED,
            "the parsing process died on this document"
            + (f" (signal {', '.join(str(s) for s in signals)})" if signals else ""),
        )

    def _timeout(self, budget: float) -> IndexingFailed:
        return IndexingFailed(
            ErrorCode.DOCUMENT_PARSE_TIMEOUT,
            f"parsing and chunking took longer than {budget:g} s",
        )

    def _new_slot(self) -> _Slot:
        channel, worker_end = self._context.Pipe(duplex=True)
        executor = ProcessPoolExecutor(
            max_workers=1,
            mp_context=self._context,
            initializer=attach,
            # Each process caps its own address space as it starts (RLIMIT_AS).
            initargs=(worker_end, os.getpid(), self._limits.memory_limit_bytes),
        )
        return _Slot(executor=executor, channel=channel, worker_end=worker_end)

    @staticmethod
    def _close_channel(slot: _Slot) -> None:
        for end in (slot.channel, slot.worker_end):
            if end is not None:
                end.close()

    def _replace_if_swollen(self, index: int, processes: list[Any]) -> None:
        """Replaces the slot's process once its address space came near its limit (out of
        memory, or nearly): a fresh process gives the memory back, and its peak, read to
        tell a library's failed allocation from a malformed document, is the next
        document's alone."""
        limit = self._limits.memory_limit_bytes
        if limit <= 0:
            return
        for process in processes:
            peak = peak_address_space(process.pid)
            if peak is not None and peak >= NEAR_LIMIT * limit:
                self._restart(index, reason="memory")
                return

    def _restart(self, index: int, *, reason: str) -> None:
        """Kills the slot's process and gives the slot a fresh one (and a fresh pipe: the
        old one may hold the rest of the abandoned document)."""
        old = self._slots[index]
        if not self._closed:
            self._slots[index] = self._new_slot()
            self.restarts += 1
        for process in self._processes(old):
            process.kill()
        old.executor.shutdown(wait=False, cancel_futures=True)
        self._close_channel(old)
        log.warning("parse_pool.worker_restarted", slot=index, reason=reason)
