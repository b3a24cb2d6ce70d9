from __future__ import annotations

import numpy as np

from services.embedding import Embedder, HashingEmbedder


async def test_rows_are_unit_vectors_of_the_configured_dimension() -> None:
    embedder = HashingEmbedder(64)
    vectors = await embedder.embed(["refund policy", "", "!!!", "a b c d e f"])
    assert vectors.shape == (4, 64)
    assert vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-6)


async def test_deterministic_across_instances_and_batches() -> None:
    first = await HashingEmbedder(128).embed(["Refund window: 30 days"])
    second = await HashingEmbedder(128).embed(["other", "refund WINDOW 30 days"])
    np.testing.assert_array_equal(first[0], second[1])


async def test_shared_words_are_closer_than_no_shared_words() -> None:
    embedder = HashingEmbedder(256)
    refund, refund_again, server = await embedder.embed(
        ["items can be returned within 30 days", "returned items within 30 days", "server room"]
    )
    assert float(refund @ refund_again) > float(refund @ server)


def test_names_itself_as_a_hashing_model_with_approximate_tokens() -> None:
    embedder = HashingEmbedder(32)
    assert isinstance(embedder, Embedder)
    assert embedder.model == "hashing-v1-32"
    assert embedder.dimension == 32
    assert embedder.tokenizer.tokenizer_file is None
