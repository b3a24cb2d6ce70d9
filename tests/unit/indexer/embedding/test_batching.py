from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.embedding import HashingEmbedder, Vectors, embed_batched, plan_batches
from services.indexer.task import ErrorCode, IndexingFailed
from tests.support.pipeline import RecordingEmbedder


def recording(dimension: int = 16) -> RecordingEmbedder:
    """A HashingEmbedder that records each request it gets."""
    return RecordingEmbedder(HashingEmbedder(dimension))


def words(text: str) -> int:
    return len(text.split())


async def test_rows_come_back_in_input_order_across_batches() -> None:
    texts = [f"text number {i}" for i in range(10)]
    embedder = recording()
    vectors = await embed_batched(embedder, texts, batch_size=3)
    assert [len(r) for r in embedder.requests] == [3, 3, 3, 1]
    np.testing.assert_array_equal(vectors, await HashingEmbedder(16).embed(texts))


async def test_token_budget_closes_a_batch_before_it_is_exceeded() -> None:
    texts = ["a b c", "d e", "f", "g h i j k l", "m"]
    embedder = recording()
    await embed_batched(embedder, texts, batch_size=10, max_batch_tokens=5, count_tokens=words)
    # a text over the budget (6 words) still goes, alone
    assert embedder.requests == [["a b c", "d e"], ["f"], ["g h i j k l"], ["m"]]


async def test_no_texts_no_request() -> None:
    embedder = recording()
    vectors = await embed_batched(embedder, [], batch_size=4)
    assert vectors.shape == (0, 16)
    assert embedder.requests == []


async def test_a_batch_with_the_wrong_shape_is_an_invalid_response() -> None:
    class Short(RecordingEmbedder):
        async def embed(self, texts: Sequence[str]) -> Vectors:
            return (await super().embed(texts))[:-1]

    with pytest.raises(IndexingFailed) as caught:
        await embed_batched(Short(HashingEmbedder(16)), ["a", "b"], batch_size=2)
    assert caught.value.code == ErrorCode.EMBEDDING_RESPONSE_INVALID


def test_bad_batch_size_is_refused() -> None:
    with pytest.raises(ValueError, match="batch_size"):
        plan_batches(["a"], batch_size=0)


@given(
    texts=st.lists(st.text(alphabet="ab ", max_size=12), max_size=30),
    batch_size=st.integers(1, 8),
    budget=st.one_of(st.none(), st.integers(1, 10)),
)
def test_plan_covers_every_text_once_within_limits(
    texts: list[str], batch_size: int, budget: int | None
) -> None:
    plan = plan_batches(texts, batch_size=batch_size, max_batch_tokens=budget, count_tokens=words)
    assert [i for batch in plan for i in batch] == list(range(len(texts)))
    for batch in plan:
        assert 1 <= len(batch) <= batch_size
        if budget is not None and len(batch) > 1:
            assert sum(words(texts[i]) for i in batch) <= budget
