"""The conversation between the indexer and a parse worker about one document.

The indexer sends the document's bytes down the worker's pipe; the worker parses, chunks
and sends back its chunks in slices, then "done" (or "failed" with a code). A send blocks
while the pipe is full, so the worker runs at most a slice ahead of the indexer, and the
indexer holds only the slice it is embedding: memory stays flat however long the document
(issue 9). Both sides of the conversation are here; ``pool.ParsePool`` runs it.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool
from multiprocessing.connection import Connection
from typing import Any, Final, cast

from services.embedding.tokens import load_token_counter
from services.indexer.chunk import Chunk
from services.indexer.pipeline.chunking import ChunkingStrategy, iter_chunks
from services.indexer.pipeline.parsing import ParseLimits, Section, parse_document
from services.indexer.pipeline.parsing.limits import memory_limit
from services.indexer.task import ErrorCode, IndexingFailed

# Chunks per message from a worker: a slice is a few hundred KB pickled.
DEFAULT_SLICE_CHUNKS: Final = 256
# How often a thread waiting for a worker's message checks that the worker still runs.
_POLL_SECONDS: Final = 0.05


class DocumentBytes:
    """A document's bytes, handed to the pool once: ``take`` gives them up, so that while
    its chunks stream back nothing in this process still holds a 50 MB document."""

    __slots__ = ("_content", "size")

    def __init__(self, content: bytes) -> None:
        self._content: bytes | None = content
        self.size = len(content)

    def take(self) -> bytes:
        content = self._content
        if content is None:
            raise RuntimeError("the document's bytes were handed over already")
        self._content = None
        return content


# What crosses back from a worker, in order: ("chunks", a slice) any number of times, then
# ("done", None) or ("failed", (code, message)) -- IndexingFailed does not survive pickling
# (its constructor takes arguments pickle does not pass), so a failure travels as data.
Message = tuple[str, Any]
OnSlice = Callable[[list[Chunk]], Awaitable[None]]

# The worker's end of its slot's pipe (set in the worker process by ``attach``).
_CHANNEL: Connection | None = None
# How often a parse process checks that its indexer still runs.
_WATCHDOG_SECONDS = 1.0


def attach(
    channel: Connection, indexer_pid: int | None = None, memory_limit_bytes: int = 0
) -> None:
    global _CHANNEL
    _CHANNEL = channel
    limit_memory(memory_limit_bytes)
    if indexer_pid is not None:
        threading.Thread(
            target=_exit_with, args=(indexer_pid,), name="parse-watchdog", daemon=True
        ).start()


def _exit_with(indexer_pid: int) -> None:
    """Ends this parse process once the indexer that started it is gone. A SIGKILLed
    indexer closes no pipe this process waits on (the executor's queue hands the child both
    of its ends), so without this it would wait, orphaned, for ever."""
    while True:
        time.sleep(_WATCHDOG_SECONDS)
        try:
            os.kill(indexer_pid, 0)
        except ProcessLookupError:
            os._exit(0)
        except PermissionError:  # the pid now belongs to another user's process
            os._exit(0)


def limit_memory(limit_bytes: int) -> bool:
    """Caps this process's address space (RLIMIT_AS) at ``limit_bytes``: past it an
    allocation fails (MemoryError, or native code aborts) instead of the parse taking the
    machine's memory. Returns whether a limit was set: 0 sets none, nor does a platform
    without RLIMIT_AS (the hard limit, if lower, wins)."""
    if limit_bytes <= 0 or not sys.platform.startswith("linux"):
        return False
    try:
        import resource

        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        if hard != resource.RLIM_INFINITY:
            limit_bytes = min(limit_bytes, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, hard))
    except (ImportError, AttributeError, ValueError, OSError):
        return False
    return True


def out_of_memory_message() -> str:
    limit = memory_limit()
    if limit is not None:
        return (
            "chunking the document needs more memory than a parse process may use "
            f"(KB_INDEXER_PARSE_MEMORY_LIMIT_BYTES = {limit})"
        )
    return "chunking the document needs more memory than there is"


def chunk_slices(
    media_type: str,
    content: bytes,
    document_id: uuid.UUID,
    version_number: int,
    strategy: ChunkingStrategy,
    limits: ParseLimits,
    slice_chunks: int,
) -> Iterator[Message]:
    """The document's messages: its chunks in slices of ``slice_chunks``, then done or
    failed. Each section is let go once chunked, and the bytes once parsed."""
    try:
        sections = parse_document(media_type, content, limits)
        del content
        sections.reverse()

        def in_order() -> Iterator[Section]:
            while sections:
                yield sections.pop()

        part: list[Chunk] = []
        for chunk in iter_chunks(
            in_order(),
            document_id=document_id,
            version_number=version_number,
            strategy=strategy,
            count_tokens=load_token_counter(strategy.tokenizer),
        ):
            part.append(chunk)
            if len(part) >= slice_chunks:
                yield "chunks", part
                part = []
        if part:
            yield "chunks", part
    except IndexingFailed as failure:
        yield "failed", (failure.code, failure.message)
        return
    except MemoryError:
        # Past the process's address-space limit while chunking (parsing reports its own).
        yield "failed", (ErrorCode.DOCUMENT_TOO_LARGE, out_of_memory_message())
        return
    yield "done", None


def stream_in_worker(
    media_type: str,
    document_id: uuid.UUID,
    version_number: int,
    strategy: ChunkingStrategy,
    limits: ParseLimits,
    slice_chunks: int,
) -> None:
    """Runs in a worker: reads the document from the slot's pipe and writes its messages
    back, one at a time. A send blocks while the pipe is full, so the worker is never more
    than a slice ahead of the indexer consuming them."""
    channel = _CHANNEL
    if channel is None:
        raise RuntimeError("parse worker started without its channel")
    messages = chunk_slices(
        media_type,
        channel.recv_bytes(),
        document_id,
        version_number,
        strategy,
        limits,
        slice_chunks,
    )
    for message in messages:
        channel.send(message)


class WorkerGone(Exception):
    """The worker process ended (killed, crashed, out of memory) before its last message,
    or its pipe broke: told apart from whatever the consumer of the slices raises."""


def receive(channel: Connection, job: Future[None]) -> Message:
    """The worker's next message (blocking: run in a thread). Raises ``WorkerGone`` when
    the worker ended without its last message, or what its job raised (a bug in it)."""
    try:
        while not channel.poll(_POLL_SECONDS):
            if job.done():
                if channel.poll(0):
                    break
                job.result()  # BrokenProcessPool, or the bug's exception
                raise WorkerGone("the parse worker ended without its last message")
        return cast(Message, channel.recv())
    except (BrokenProcessPool, EOFError, OSError) as error:
        raise WorkerGone(str(error)) from error


def send(channel: Connection, content: bytes) -> None:
    """The document's bytes down the worker's pipe (blocking: run in a thread)."""
    try:
        channel.send_bytes(content)
    except OSError as error:
        raise WorkerGone(str(error)) from error


class Overrun(Exception):
    """The document's parse budget ran out."""


class Reported(Exception):
    """The worker reported the document's failure (and finished its job)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(code, message)
        self.failure = IndexingFailed(code, message)


async def consume(
    next_message: Callable[[], Awaitable[Message]], budget: float, on_slice: OnSlice
) -> int:
    """Hands each slice to ``on_slice`` until done; returns the chunk count. The budget
    counts the time spent waiting for the parser, not the consumer's own time: a slow
    embedder holding the parser back (its next send blocks) does not use up the parse's."""
    remaining = budget
    count = 0
    while True:
        began = time.monotonic()
        try:
            kind, body = await asyncio.wait_for(next_message(), max(remaining, 0.0))
        except TimeoutError:
            raise Overrun from None
        remaining -= time.monotonic() - began
        if kind == "chunks":
            count += len(body)
            await on_slice(body)
        elif kind == "done":
            return count
        else:
            raise Reported(*body)
