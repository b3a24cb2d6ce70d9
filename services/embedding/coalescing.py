"""One embedding queue per process and model: the texts of every concurrent caller packed
into full requests.

A document of one or two chunks makes a request of one or two inputs, and a model charges
per request as well as per input (its fixed cost, the round trip): a worker indexing many
small documents at once keeps the provider busy on nearly empty requests. Here every
caller's texts join one queue, and a request leaves as soon as it is full
(``batch_size`` texts or ``max_batch_tokens`` tokens), or after ``linger_seconds`` with what
has gathered. Full requests go out up to ``max_requests_in_flight`` at once; a partial one only when
no request is outstanding, so that a provider slower than the callers gets full requests
(its cost per input is lowest there) instead of a queue of small ones.

Each caller still gets exactly its own rows, and its own errors:
- a request that fails (rate limited, unavailable, a malformed answer) fails every caller
  with texts in it, each of which applies its own task's retry policy;
- an input the provider refuses on its own (``InputRefused``) fails only the caller it
  belongs to, at that caller's position; the request's other texts go back to the head of
  the queue and are sent again without it;
- a caller that goes away (its lease lost, its task cancelled) leaves the queue: its texts
  not yet sent are dropped, its rows of a request in flight are thrown away.
A queue serves one model: the callers' chunks never mix models.

Each request is one span (``kb.index.embed``), in the trace of the first of its callers
that is sampled, and every caller's span links to the requests its texts went in: one span
for the ten documents a request may carry, not one each (a span costs the indexer as much
as a short document's embedding by the hashing stand-in).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from opentelemetry.trace import Span, SpanContext

from services.embedding.batching import Batching, RequestBudget
from services.embedding.port import (
    Embedder,
    InputRefused,
    PassedThroughIdentity,
    Vectors,
    checked_vectors,
)
from services.embedding.tokens import TokenCounter, approximate_tokens
from services.runtime.tracing.propagation import current_traceparent
from services.runtime.tracing.spans import Attributes, batch_span, link_current_to, mark_failed


@dataclass(eq=False)
class _Caller:
    texts: Sequence[str]
    rows: Vectors
    done: asyncio.Future[Vectors]
    # The caller's span, when it traces: its requests' span is started under the first
    # sampled caller's, and each caller links to the requests it was in.
    traceparent: str | None = None
    requests: list[SpanContext] = field(default_factory=list)
    waiting: int = field(init=False)

    def __post_init__(self) -> None:
        self.waiting = len(self.texts)

    @property
    def gone(self) -> bool:
        return self.done.done()


@dataclass(frozen=True)
class _Item:
    caller: _Caller
    position: int  # in the caller's texts
    tokens: int


@dataclass(frozen=True)
class RequestStats:
    """What one request carried, for metrics and benchmarks."""

    inputs: int
    callers: int
    seconds: float


class CoalescingEmbedder(PassedThroughIdentity):
    """Packs the texts of concurrent ``embed_all`` calls into requests of ``inner``."""

    def __init__(
        self,
        inner: Embedder,
        batching: Batching,
        *,
        count_tokens: TokenCounter | None = None,
        on_request: Callable[[RequestStats], None] | None = None,
        ready: asyncio.Future[None] | None = None,
    ) -> None:
        # Refuses a batch size or budget below 1.
        RequestBudget(batching.batch_size, batching.max_batch_tokens)
        if batching.max_requests_in_flight < 1 or batching.linger_seconds < 0:
            raise ValueError("max_in_flight must be >= 1 and linger_seconds >= 0")
        self.inner = inner
        self.batch_size = batching.batch_size
        self.max_batch_tokens = batching.max_batch_tokens
        # Without the model's counter, the approximate one errs high: requests stay in budget.
        self._count = count_tokens or approximate_tokens
        self.linger_seconds = batching.linger_seconds
        self.max_in_flight = batching.max_requests_in_flight
        self._on_request = on_request
        # The provider warming up (a local model loading) while tasks are claimed and
        # parsed: requests wait for it; if it failed, they fail with its error.
        self._ready = ready
        self._queue: deque[_Item] = deque()
        self._queued_tokens = 0
        self._in_flight: set[asyncio.Task[None]] = set()
        self._arrived = asyncio.Event()
        self._dispatcher: asyncio.Task[None] | None = None

    # --- callers ----------------------------------------------------------------------------

    async def embed_all(self, texts: Sequence[str]) -> Vectors:
        """Every text's vector, row i = texts[i], however many texts: they go out in the
        queue's requests, beside other callers' texts."""
        rows = np.empty((len(texts), self.dimension), dtype=np.float32)
        if not texts:
            return rows
        caller = _Caller(
            texts, rows, asyncio.get_running_loop().create_future(), current_traceparent()
        )
        for position, text in enumerate(texts):
            tokens = self._count(text) if self.max_batch_tokens is not None else 0
            self._queue.append(_Item(caller, position, tokens))
            self._queued_tokens += tokens
        self._arrived.set()
        self._dispatch_soon()
        try:
            return await caller.done
        finally:
            if not caller.done.done():
                caller.done.cancel()  # cancelled: what is still queued is dropped when met
            link_current_to(caller.requests)

    async def aclose(self) -> None:
        """Stop the dispatcher and wait for requests in flight (their callers are answered)."""
        if self._dispatcher is not None:
            self._dispatcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._dispatcher
        if self._in_flight:
            await asyncio.gather(*self._in_flight, return_exceptions=True)

    # --- the dispatcher ---------------------------------------------------------------------

    def _dispatch_soon(self) -> None:
        """Starts the dispatcher unless it runs (it ends when the queue is empty)."""
        if self._dispatcher is None or self._dispatcher.done():
            self._dispatcher = asyncio.create_task(self._dispatch())

    async def _dispatch(self) -> None:
        """Sends requests while texts are queued; ends when the queue is empty (the next
        caller starts another)."""
        while True:
            self._drop_gone()
            if not self._queue:
                return
            if len(self._in_flight) >= self.max_in_flight:
                await asyncio.wait(self._in_flight, return_when=asyncio.FIRST_COMPLETED)
                continue
            if not self._full() and self._in_flight:
                # A partial request would only wait at the provider behind the one out:
                # the queue fills meanwhile, and goes when full or when that one is back.
                await self._arrival_or_answer()
                continue
            if not self._full():
                # Give concurrent callers a moment to fill the request.
                await self._linger()
                self._drop_gone()
                if not self._queue:
                    return
            batch = self._take()
            request = asyncio.create_task(self._send(batch))
            self._in_flight.add(request)
            request.add_done_callback(self._in_flight.discard)

    async def _arrival_or_answer(self) -> None:
        self._arrived.clear()
        arrival = asyncio.create_task(self._arrived.wait())
        try:
            await asyncio.wait({arrival, *self._in_flight}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            arrival.cancel()

    async def _linger(self) -> None:
        """Until the queue fills a request, or ``linger_seconds`` have passed."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.linger_seconds
        while not self._full():
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            self._arrived.clear()
            try:
                async with asyncio.timeout(remaining):
                    await self._arrived.wait()
            except TimeoutError:
                return

    def _full(self) -> bool:
        if len(self._queue) >= self.batch_size:
            return True
        return self.max_batch_tokens is not None and self._queued_tokens >= self.max_batch_tokens

    def _drop_gone(self) -> None:
        while self._queue and self._queue[0].caller.gone:
            self._queued_tokens -= self._queue.popleft().tokens

    def _take(self) -> list[_Item]:
        """The next request's texts, taken in queue order within one ``RequestBudget`` and
        sent shortest first (by tokens when counted, else characters): a provider that
        pads each of its model runs to the longest input in it pads little."""
        batch: list[_Item] = []
        budget = RequestBudget(self.batch_size, self.max_batch_tokens)
        while self._queue:
            item = self._queue[0]
            if not item.caller.gone and not budget.admits(item.tokens):
                break
            self._queue.popleft()
            self._queued_tokens -= item.tokens
            if not item.caller.gone:
                budget.add(item.tokens)
                batch.append(item)
        batch.sort(key=lambda item: (item.tokens, len(item.caller.texts[item.position])))
        return batch

    async def _send(self, batch: list[_Item]) -> None:
        callers = list(dict.fromkeys(item.caller for item in batch))
        attributes = self._request_attributes(len(batch), len(callers))
        with batch_span("kb.index.embed", [c.traceparent for c in callers], attributes) as span:
            request = span.get_span_context()
            # An unsampled request span is never exported: a link to it would lead nowhere.
            if request.is_valid and request.trace_flags.sampled:
                for caller in callers:
                    caller.requests.append(request)
            await self._send_traced(batch, span)

    def _request_attributes(self, texts: int, callers: int) -> Attributes:
        """The GenAI semantic conventions' names: the provider (its class, under the guard),
        the model, the texts and the request size; and how many callers shared it."""
        provider: object = self.inner
        while isinstance(provider, PassedThroughIdentity):
            provider = provider.inner
        return {
            "gen_ai.operation.name": "embeddings",
            "gen_ai.provider.name": type(provider).__name__,
            "gen_ai.request.model": self.model,
            "kb.embedding.texts": texts,
            "kb.embedding.batch_size": self.batch_size,
            "kb.embedding.callers": callers,
        }

    async def _send_traced(self, batch: list[_Item], span: Span) -> None:
        started = time.perf_counter()
        try:
            if self._ready is not None:
                await asyncio.shield(self._ready)
            vectors = checked_vectors(
                await self.inner.embed([i.caller.texts[i.position] for i in batch]),
                rows=len(batch),
                dimension=self.dimension,
                source=self.model,
            )
        except InputRefused as refused:
            mark_failed(span, refused)
            self._refused(batch, refused)
            return
        except asyncio.CancelledError:
            for caller in {item.caller for item in batch}:
                if not caller.gone:
                    caller.done.cancel()
            raise
        except Exception as error:
            mark_failed(span, error)
            for caller in {item.caller for item in batch}:
                if not caller.gone:
                    caller.done.set_exception(error)
            return
        finally:
            self._report(batch, time.perf_counter() - started)
        for item, vector in zip(batch, vectors, strict=True):
            caller = item.caller
            if caller.gone:
                continue
            caller.rows[item.position] = vector
            caller.waiting -= 1
            if caller.waiting == 0:
                caller.done.set_result(caller.rows)

    def _refused(self, batch: list[_Item], refused: InputRefused) -> None:
        """Only the refused input's caller fails; the rest of the request goes back to the
        head of the queue, in order, to be sent without it."""
        if not 0 <= refused.position < len(batch):
            for caller in {item.caller for item in batch}:
                if not caller.gone:
                    caller.done.set_exception(refused)
            return
        culprit = batch[refused.position]
        if not culprit.caller.gone:
            culprit.caller.done.set_exception(InputRefused(culprit.position, refused.detail))
        for item in reversed(batch):
            if not item.caller.gone:
                self._queue.appendleft(item)
                self._queued_tokens += item.tokens
        self._arrived.set()
        self._dispatch_soon()

    def _report(self, batch: list[_Item], seconds: float) -> None:
        if self._on_request is not None:
            callers = len({id(item.caller) for item in batch})
            self._on_request(RequestStats(len(batch), callers, seconds))
