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
import functools
import importlib
import multiprocessing
import os
import select
import uuid
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, Final

from services.indexer.chunking import Chunk, ChunkingStrategy, chunk_sections
from services.indexer.parsing import ParseLimits, parse_document
from services.indexer.task import ErrorCode, IndexingFailed
from services.indexer.tokens import TokenCounter, TokenizerSpec, load_token_counter
from services.runtime.logging import get_logger

log = get_logger(__name__)

_START_METHOD: Final = "forkserver"
_DEFAULT_LIMITS: Final = ParseLimits()
_PRELOAD: Final = ("services.indexer.parsing.pool", "tokenizers")


@functools.lru_cache(maxsize=4)
def _token_counter(spec: TokenizerSpec) -> TokenCounter:
    """Loaded once per process and tokenizer."""
    return load_token_counter(spec)


# What crosses back from a worker: IndexingFailed does not survive pickling (its
# constructor takes arguments pickle does not pass), so a failure travels as code+message.
_Outcome = tuple[list[Chunk], None] | tuple[None, tuple[str, str]]


def _parse_and_chunk(
    media_type: str,
    content: bytes,
    document_id: uuid.UUID,
    version_number: int,
    strategy: ChunkingStrategy,
    limits: ParseLimits,
) -> _Outcome:
    try:
        sections = parse_document(media_type, content, limits)
        chunks = chunk_sections(
            sections,
            document_id=document_id,
            version_number=version_number,
            strategy=strategy,
            count_tokens=_token_counter(strategy.tokenizer),
        )
    except IndexingFailed as failure:
        return None, (failure.code, failure.message)
    return chunks, None


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


@dataclass
class _Slot:
    executor: ProcessPoolExecutor
    # Set by the slot's first use: starting a process (and the forkserver) blocks.
    warm: Future[None] | None = None


class ParsePool:
    """``workers`` processes parsing and chunking one document each; callers beyond that
    wait for a free one (the wait is not part of a document's budget)."""

    def __init__(
        self, *, workers: int = 1, limits: ParseLimits = _DEFAULT_LIMITS, inline: bool = False
    ) -> None:
        if workers < 1:
            raise ValueError("a parse pool needs at least one worker")
        self._limits = limits
        self._inline = inline
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
        """The document's chunks. Raises ``IndexingFailed``: the parse codes, and
        DOCUMENT_PARSE_TIMEOUT past the budget (``ParseLimits.budget_seconds`` unless
        given), DOCUMENT_PARSE_FAILED if the worker process died."""
        if self._closed:
            raise RuntimeError("the parse pool is closed")
        budget = self._limits.budget_seconds if budget_seconds is None else budget_seconds
        args = (media_type, content, document_id, version_number, strategy, self._limits)
        if self._inline:
            outcome = await self._run_inline(args, budget)
        else:
            outcome = await self._run_in_slot(args, budget)
        chunks, failure = outcome
        if failure is not None:
            raise IndexingFailed(*failure)
        assert chunks is not None
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

    # -- running ---------------------------------------------------------------------------

    async def _run_inline(
        self,
        args: tuple[str, bytes, uuid.UUID, int, ChunkingStrategy, ParseLimits],
        budget: float,
    ) -> _Outcome:
        # A thread cannot be stopped: past the budget the caller moves on and the thread
        # finishes on its own. Inline mode is for tests.
        try:
            return await asyncio.wait_for(asyncio.to_thread(_parse_and_chunk, *args), budget)
        except TimeoutError:
            raise self._timeout(budget) from None

    async def _run_in_slot(
        self,
        args: tuple[str, bytes, uuid.UUID, int, ChunkingStrategy, ParseLimits],
        budget: float,
    ) -> _Outcome:
        index = await self._free.get()
        try:
            try:
                job = await self._submit(index, args)
                return await asyncio.wait_for(job, budget)
            except TimeoutError:
                self._restart(index, reason="budget")
                raise self._timeout(budget) from None
            except BrokenProcessPool:
                self._restart(index, reason="died")
                raise IndexingFailed(
                    ErrorCode.DOCUMENT_PARSE_FAILED,
                    "the parsing process died (out of memory or crashed) on this document",
                ) from None
            except asyncio.CancelledError:
                # Nobody wants the result: do not let the slot keep parsing it.
                self._restart(index, reason="cancelled")
                raise
        finally:
            if not self._closed:
                self._free.put_nowait(index)

    async def _submit(
        self, index: int, args: tuple[str, bytes, uuid.UUID, int, ChunkingStrategy, ParseLimits]
    ) -> asyncio.Future[_Outcome]:
        for attempt in range(2):
            slot = self._slots[index]
            if slot.warm is None:
                slot.warm = await asyncio.to_thread(slot.executor.submit, _warm_up)
            if not slot.warm.done():
                # A fresh process imports the parsers first, outside any document's budget.
                with contextlib.suppress(Exception):
                    await asyncio.wrap_future(slot.warm)
            if attempt == 0 and not self._alive(slot):
                # It died while idle (or starting): not this document's doing.
                self._restart(index, reason="died_idle")
                continue
            break
        return asyncio.wrap_future(slot.executor.submit(_parse_and_chunk, *args))

    @staticmethod
    def _processes(slot: _Slot) -> list[Any]:
        # ProcessPoolExecutor has no public way to see or stop its processes before
        # Python 3.14 (terminate_workers); its process table is the only handle.
        return list(dict(getattr(slot.executor, "_processes", None) or {}).values())

    def _alive(self, slot: _Slot) -> bool:
        return not any(_exited(process) for process in self._processes(slot))

    def _timeout(self, budget: float) -> IndexingFailed:
        return IndexingFailed(
            ErrorCode.DOCUMENT_PARSE_TIMEOUT,
            f"parsing and chunking took longer than {budget:g} s",
        )

    def _new_slot(self) -> _Slot:
        executor = ProcessPoolExecutor(max_workers=1, mp_context=self._context)
        return _Slot(executor=executor)

    def _restart(self, index: int, *, reason: str) -> None:
        """Kills the slot's process and gives the slot a fresh one."""
        old = self._slots[index]
        if not self._closed:
            self._slots[index] = self._new_slot()
            self.restarts += 1
        for process in self._processes(old):
            process.kill()
        old.executor.shutdown(wait=False, cancel_futures=True)
        log.warning("parse_pool.worker_restarted", slot=index, reason=reason)
