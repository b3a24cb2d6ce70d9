"""The test provider's quota, as the quota benchmark and the limiter's tests rely on it:
a request beyond the bucket is a 429 with the seconds it must wait, and costs nothing."""

from __future__ import annotations

import httpx

from tests.support.embedding_provider import IN_PROCESS_URL, EmbeddingProvider, Quota


async def post(client: httpx.AsyncClient, texts: list[str]) -> httpx.Response:
    return await client.post(f"{IN_PROCESS_URL}/embeddings", json={"input": texts, "model": "m"})


async def test_requests_beyond_the_bucket_are_429_with_retry_after() -> None:
    provider = EmbeddingProvider(dimension=8)
    # 30 requests a minute, a bucket of 2 s: one request at once, the next in 2 s.
    provider.set_quota(Quota(requests_per_minute=30, burst_seconds=2))
    async with httpx.AsyncClient(transport=provider.transport()) as client:
        first = await post(client, ["a"])
        second = await post(client, ["b"])
    assert first.status_code == 200
    assert second.status_code == 429
    assert second.headers["retry-after"] == "2"
    assert provider.stats() == {"answered": {"200": 1, "429": 1}, "tokens_answered": 1}


async def test_tokens_are_metered_as_the_approximate_tokenizer_counts() -> None:
    provider = EmbeddingProvider(dimension=8)
    # 600 tokens a minute in a bucket of 1 s: 10 tokens; a 30-character text is 10 tokens.
    provider.set_quota(Quota(tokens_per_minute=600, burst_seconds=1))
    async with httpx.AsyncClient(transport=provider.transport()) as client:
        fits = await post(client, ["x" * 30])
        refused = await post(client, ["y" * 3])
    assert (fits.status_code, refused.status_code) == (200, 429)
    assert provider.stats()["tokens_answered"] == 10


async def test_no_quota_answers_everything() -> None:
    provider = EmbeddingProvider(dimension=8)
    provider.set_quota(Quota(requests_per_minute=1))
    provider.set_quota(None)
    async with httpx.AsyncClient(transport=provider.transport()) as client:
        answers = [await post(client, [f"t{i}"]) for i in range(5)]
    assert [answer.status_code for answer in answers] == [200] * 5
    assert provider.stats()["answered"] == {"200": 5}
