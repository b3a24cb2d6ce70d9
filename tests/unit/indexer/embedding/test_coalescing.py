"""The process-wide embedding queue: concurrent callers' texts packed into full requests,
each caller answered with its own rows and its own errors."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np
import pytest

from services.embedding import HashingEmbedder, InputRefused, Vectors
from services.embedding.batching import Batching
from services.embedding.coalescing import CoalescingEmbedder, RequestStats
from services.runtime.indexing.index_failures import ErrorCode, IndexingFailed
from services.runtime.tracing.spans import span_under
from tests.support.pipeline import RecordingEmbedder
from tests.support.tracing import linked_span_ids, named, parent_id, span_id, trace_id, traced

DIMENSION = 16


class Gated(RecordingEmbedder):
    """Records requests; each waits for ``release`` when ``gate`` is set; a text starting
    with "boom" fails its request, one starting with "refused" is refused on its own."""

    def __init__(self) -> None:
        super().__init__(HashingEmbedder(DIMENSION))
        self.gate: asyncio.Event | None = None
        self.started = asyncio.Event()

    async def embed(self, texts: Sequence[str]) -> Vectors:
        self.requests.append(list(texts))
        self.started.set()
        if self.gate is not None:
            await self.gate.wait()
        for position, text in enumerate(texts):
            if text.startswith("refused"):
                raise InputRefused(position, "too long")
        if any(text.startswith("boom") for text in texts):
            raise IndexingFailed(ErrorCode.EMBEDDING_UNAVAILABLE, "provider down")
        return await self.inner.embed(texts)


async def expected(texts: Sequence[str]) -> Vectors:
    return await HashingEmbedder(DIMENSION).embed(texts)


async def test_concurrent_callers_share_full_requests_and_get_their_own_rows() -> None:
    inner = Gated()
    stats: list[RequestStats] = []
    queue = CoalescingEmbedder(
        inner, Batching(batch_size=8, linger_seconds=0.05), on_request=stats.append
    )
    documents = [[f"doc {d} chunk {c}" for c in range(3)] for d in range(10)]
    answers = await asyncio.gather(*(queue.embed_all(texts) for texts in documents))
    for texts, rows in zip(documents, answers, strict=True):
        np.testing.assert_array_equal(rows, await expected(texts))
    assert sorted(inner.texts) == sorted(t for texts in documents for t in texts)
    # 30 texts in requests of 8: four requests, not ten.
    assert [len(r) for r in inner.requests] == [8, 8, 8, 6]
    assert max(s.callers for s in stats) > 1


async def test_a_request_is_sent_shortest_text_first_and_rows_go_back_in_order() -> None:
    inner = Gated()
    queue = CoalescingEmbedder(inner, Batching(batch_size=8, linger_seconds=0))
    texts = ["a longer text of six words", "short", "a text of five words here", "mid text"]
    np.testing.assert_array_equal(await queue.embed_all(texts), await expected(texts))
    assert inner.requests == [sorted(texts, key=len)]
    counted = Gated()
    by_tokens = CoalescingEmbedder(
        counted,
        Batching(batch_size=8, max_batch_tokens=100, linger_seconds=0),
        count_tokens=lambda text: len(text.split()),
    )
    words = ["one two three", "abcdefghijklmnop", "x y"]
    np.testing.assert_array_equal(await by_tokens.embed_all(words), await expected(words))
    assert counted.requests == [["abcdefghijklmnop", "x y", "one two three"]]


async def test_a_full_request_does_not_wait_for_the_linger() -> None:
    inner = Gated()
    queue = CoalescingEmbedder(inner, Batching(batch_size=4, linger_seconds=60))
    async with asyncio.timeout(5):
        rows = await queue.embed_all(["a", "b", "c", "d"])
    np.testing.assert_array_equal(rows, await expected(["a", "b", "c", "d"]))


async def test_a_lone_short_caller_is_answered_after_the_linger() -> None:
    queue = CoalescingEmbedder(Gated(), Batching(batch_size=32, linger_seconds=0.01))
    async with asyncio.timeout(5):
        rows = await queue.embed_all(["only one"])
    assert rows.shape == (1, DIMENSION)


async def test_a_caller_larger_than_a_request_spans_several() -> None:
    inner = Gated()
    queue = CoalescingEmbedder(inner, Batching(batch_size=3, linger_seconds=0))
    texts = [f"t{i}" for i in range(7)]
    np.testing.assert_array_equal(await queue.embed_all(texts), await expected(texts))
    assert sorted(len(r) for r in inner.requests) == [1, 3, 3]


async def test_a_failed_request_fails_each_caller_in_it_and_no_other() -> None:
    inner = Gated()
    inner.gate = asyncio.Event()
    queue = CoalescingEmbedder(
        inner, Batching(batch_size=2, linger_seconds=0.05, max_requests_in_flight=1)
    )
    first = asyncio.create_task(queue.embed_all(["boom one"]))
    second = asyncio.create_task(queue.embed_all(["fine two"]))
    await inner.started.wait()  # the first request holds both texts
    third = asyncio.create_task(queue.embed_all(["fine three"]))
    await asyncio.sleep(0)
    inner.gate.set()
    for task in (first, second):
        with pytest.raises(IndexingFailed) as failed:
            await task
        assert failed.value.code == ErrorCode.EMBEDDING_UNAVAILABLE
    assert (await third).shape == (1, DIMENSION)
    assert inner.requests == [["boom one", "fine two"], ["fine three"]]


async def test_a_refused_input_fails_its_caller_only_at_its_own_position() -> None:
    inner = Gated()
    queue = CoalescingEmbedder(inner, Batching(batch_size=8, linger_seconds=0.05))
    good = ["g1", "g2"]
    bad = ["b0", "refused b1", "b2"]
    results = await asyncio.gather(
        queue.embed_all(good), queue.embed_all(bad), return_exceptions=True
    )
    np.testing.assert_array_equal(results[0], await expected(good))
    refused = results[1]
    assert isinstance(refused, InputRefused)
    assert refused.position == 1
    # The request was sent again without the refused caller's texts.
    assert inner.requests[-1] == ["g1", "g2"]


async def test_a_cancelled_caller_leaves_the_queue() -> None:
    inner = Gated()
    inner.gate = asyncio.Event()
    queue = CoalescingEmbedder(
        inner, Batching(batch_size=1, linger_seconds=0, max_requests_in_flight=1)
    )
    holder = asyncio.create_task(queue.embed_all(["in flight"]))
    await inner.started.wait()
    leaving = asyncio.create_task(queue.embed_all(["never sent"]))
    staying = asyncio.create_task(queue.embed_all(["sent"]))
    await asyncio.sleep(0)
    leaving.cancel()
    inner.gate.set()
    await holder
    await staying
    with pytest.raises(asyncio.CancelledError):
        await leaving
    assert inner.requests == [["in flight"], ["sent"]]


async def test_requests_keep_to_the_token_budget() -> None:
    inner = Gated()
    queue = CoalescingEmbedder(
        inner,
        Batching(batch_size=10, max_batch_tokens=5, linger_seconds=0.05, max_requests_in_flight=1),
        count_tokens=lambda text: len(text.split()),
    )
    await asyncio.gather(queue.embed_all(["a b c", "d e"]), queue.embed_all(["f", "g h i j k l"]))
    # Taken in queue order, each request sent shortest first.
    assert inner.requests == [["d e", "a b c"], ["f"], ["g h i j k l"]]


async def test_no_texts_no_request() -> None:
    inner = Gated()
    queue = CoalescingEmbedder(inner, Batching(batch_size=4))
    assert (await queue.embed_all([])).shape == (0, DIMENSION)
    assert inner.requests == []


async def test_requests_wait_for_the_provider_to_be_ready() -> None:
    inner = Gated()
    ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    queue = CoalescingEmbedder(inner, Batching(batch_size=1, linger_seconds=0), ready=ready)
    waiting = asyncio.create_task(queue.embed_all(["early"]))
    for _ in range(5):
        await asyncio.sleep(0)
    assert inner.requests == []  # claimed and parsed, but the model is still loading
    ready.set_result(None)
    assert (await waiting).shape == (1, DIMENSION)
    assert inner.requests == [["early"]]


async def test_a_failed_warm_up_fails_the_requests_with_its_error() -> None:
    inner = Gated()
    ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    ready.set_exception(IndexingFailed(ErrorCode.EMBEDDING_UNAVAILABLE, "model file rejected"))
    queue = CoalescingEmbedder(inner, Batching(batch_size=1, linger_seconds=0), ready=ready)
    with pytest.raises(IndexingFailed, match="model file rejected"):
        await queue.embed_all(["text"])
    assert inner.requests == []


async def test_a_partial_request_waits_while_another_is_out() -> None:
    inner = Gated()
    inner.gate = asyncio.Event()
    queue = CoalescingEmbedder(
        inner, Batching(batch_size=4, linger_seconds=0, max_requests_in_flight=2)
    )
    first = asyncio.create_task(queue.embed_all(["first"]))
    await inner.started.wait()
    later = [asyncio.create_task(queue.embed_all([f"later {i}"])) for i in range(3)]
    for _ in range(10):
        await asyncio.sleep(0)
    # A slow provider is not sent three requests of one text: they wait for it, together.
    assert inner.requests == [["first"]]
    inner.gate.set()
    await asyncio.gather(first, *later)
    assert inner.requests == [["first"], ["later 0", "later 1", "later 2"]]


async def test_full_requests_go_out_while_another_is_out() -> None:
    inner = Gated()
    inner.gate = asyncio.Event()
    queue = CoalescingEmbedder(
        inner, Batching(batch_size=2, linger_seconds=0, max_requests_in_flight=2)
    )
    first = asyncio.create_task(queue.embed_all(["a", "b"]))
    await inner.started.wait()
    second = asyncio.create_task(queue.embed_all(["c", "d"]))
    for _ in range(10):
        await asyncio.sleep(0)
    assert inner.requests == [["a", "b"], ["c", "d"]]
    inner.gate.set()
    await asyncio.gather(first, second)


async def test_a_request_is_one_span_that_each_of_its_callers_links_to() -> None:
    inner = Gated()
    queue = CoalescingEmbedder(inner, Batching(batch_size=8, linger_seconds=0.05))
    traces = [f"00-{n:032x}-{n:016x}-01" for n in range(1, 5)]

    async def document(traceparent: str, texts: list[str]) -> None:
        with span_under("kb.index.parse_and_chunk", traceparent):
            await queue.embed_all(texts)

    with traced() as exported:
        await asyncio.gather(
            *(document(t, [f"doc {n} a", f"doc {n} b"]) for n, t in enumerate(traces[:3]))
        )
        with pytest.raises(IndexingFailed):
            await document(traces[3], ["boom"])
        spans = exported.get_finished_spans()
    assert [len(r) for r in inner.requests] == [6, 1]
    shared, failed = named(spans, "kb.index.embed")  # one a request, not one a document
    assert shared.attributes is not None
    assert shared.attributes["kb.embedding.texts"] == 6
    assert shared.attributes["kb.embedding.callers"] == 3
    assert shared.attributes["gen_ai.provider.name"] == "HashingEmbedder"
    parses = {trace_id(p): p for p in named(spans, "kb.index.parse_and_chunk")}
    # In the first caller's trace, under its span; every caller's span links to it.
    assert (trace_id(shared), parent_id(shared)) == (1, span_id(parses[1]))
    for n in (1, 2, 3):
        assert linked_span_ids(parses[n]) == [span_id(shared)]
    assert failed.attributes is not None
    assert failed.attributes["error.type"] == ErrorCode.EMBEDDING_UNAVAILABLE
    assert linked_span_ids(parses[4]) == [span_id(failed)]
