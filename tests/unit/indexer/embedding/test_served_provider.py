"""The test provider on a real port (as e2e tests and the demo use it): real HTTP timeouts,
and its control API from outside."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from services.embedding import HashingEmbedder, embed_batched
from services.embedding.openai_http import OpenAIHttpEmbedder
from services.indexer.task import ErrorCode, IndexingFailed
from tests.support.embedding_provider import EmbeddingProvider, ServedProvider, served_provider


@pytest.fixture(scope="module")
def served() -> Iterator[ServedProvider]:
    with served_provider(EmbeddingProvider(dimension=16)) as running:
        yield running


@pytest.fixture(autouse=True)
def clean(served: ServedProvider) -> Iterator[None]:
    yield
    served.control.clear_faults()
    served.control.set_limits(max_input_chars=None)
    served.provider.clear_requests()


def embedder(served: ServedProvider, timeout_seconds: float = 5.0) -> OpenAIHttpEmbedder:
    return OpenAIHttpEmbedder(
        base_url=served.base_url,
        model="served-model",
        dimension=16,
        timeout_seconds=timeout_seconds,
        encoding_format="base64",
    )


async def test_embeds_over_real_http(served: ServedProvider) -> None:
    client = embedder(served)
    texts = [f"paragraph {i}" for i in range(5)]
    vectors = await embed_batched(client, texts, batch_size=2)
    await client.aclose()
    np.testing.assert_array_equal(vectors, HashingEmbedder(16).embed_sync(texts))
    assert [len(r.inputs) for r in served.control.requests()] == [2, 2, 1]


async def test_a_hang_past_the_client_timeout_is_a_timeout(served: ServedProvider) -> None:
    served.control.inject("hang", hang_seconds=30, times=1)
    client = embedder(served, timeout_seconds=0.3)
    with pytest.raises(IndexingFailed) as caught:
        await client.embed(["x"])
    await client.aclose()
    assert caught.value.code == ErrorCode.EMBEDDING_TIMEOUT


async def test_faults_switched_on_and_off_from_outside(served: ServedProvider) -> None:
    client = embedder(served)
    served.control.inject("rate_limit", retry_after="3")
    for _ in range(2):
        with pytest.raises(IndexingFailed) as caught:
            await client.embed(["x"])
        assert caught.value.retry_after_seconds == 3.0
    served.control.clear_faults()
    assert (await client.embed(["x"])).shape == (1, 16)
    await client.aclose()


async def test_a_fault_can_target_requests_by_their_text(served: ServedProvider) -> None:
    served.control.inject("status", status=502, match="poison")
    client = embedder(served)
    assert (await client.embed(["healthy"])).shape == (1, 16)
    with pytest.raises(IndexingFailed) as caught:
        await client.embed(["healthy", "poison pill"])
    await client.aclose()
    assert caught.value.code == ErrorCode.EMBEDDING_UNAVAILABLE
    assert [r.fault for r in served.control.requests()] == [None, "status"]
