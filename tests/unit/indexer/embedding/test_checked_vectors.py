"""``checked_vectors``: what an embedder's answer must be before it may reach the index."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.embedding import HashingEmbedder, checked_vectors
from services.embedding.port import MIN_VECTOR_NORM
from services.indexer.task import ErrorCode, IndexingFailed


def test_unit_and_small_but_real_vectors_pass() -> None:
    vectors = np.array([[1.0, 0.0, 0.0], [0.0, 1e-3, 0.0]], dtype=np.float32)
    assert checked_vectors(vectors, rows=2, dimension=3, source="test") is vectors


@pytest.mark.parametrize("row", [[0.0, 0.0, 0.0], [0.0, -0.0, 1e-9]])
def test_a_zero_norm_vector_is_an_invalid_response(row: list[float]) -> None:
    # Its cosine score would be NaN on the exact path.
    vectors = np.array([[1.0, 0.0, 0.0], row], dtype=np.float32)
    with pytest.raises(IndexingFailed) as caught:
        checked_vectors(vectors, rows=2, dimension=3, source="test")
    assert caught.value.code == ErrorCode.EMBEDDING_RESPONSE_INVALID
    assert "input 1" in str(caught.value)


def test_no_rows_is_fine() -> None:
    vectors = np.zeros((0, 3), dtype=np.float32)
    assert checked_vectors(vectors, rows=0, dimension=3, source="test").shape == (0, 3)


@given(st.lists(st.text(max_size=40), min_size=1, max_size=8))
def test_the_hashing_embedder_never_answers_a_zero_vector(texts: list[str]) -> None:
    # Tests and chaos runs index through it: it must pass the check for any text, including
    # texts without words and words whose hashed signs cancel out.
    embedder = HashingEmbedder(4)  # few buckets: cancellations are likely
    vectors = embedder.embed_sync(texts)
    assert (np.linalg.norm(vectors, axis=1) >= MIN_VECTOR_NORM).all()
    checked_vectors(vectors, rows=len(texts), dimension=4, source="hashing")


def test_cancelling_signs_still_give_a_unit_vector() -> None:
    embedder = HashingEmbedder(1)  # every word in one bucket: signs meet
    words = [f"w{n}" for n in range(24)]
    for a in words:
        for b in words:
            vector = embedder.embed_sync([f"{a} {b}"])
            checked_vectors(vector, rows=1, dimension=1, source="hashing")
