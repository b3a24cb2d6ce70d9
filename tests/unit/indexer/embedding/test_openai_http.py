"""The OpenAI-compatible provider against our test provider (in process, over ASGI), every
fault mapped to its code and to the retry policy's decision."""

from __future__ import annotations

import socket
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from typing import Any

import numpy as np
import pytest
from pydantic import SecretStr

from services.embedding import HashingEmbedder, embed_batched
from services.embedding.openai_http import OpenAIHttpEmbedder
from services.embedding.port import InputRefused
from services.indexer.retry import RetryPolicy
from services.indexer.task import (
    TASK_TYPE_INDEX_VERSION,
    ErrorCode,
    IndexingFailed,
    Lease,
    TaskStatus,
)
from tests.support.embedding_provider import IN_PROCESS_URL, EmbeddingProvider, Limits

KEY = "sk-test-0123456789abcdef"
MODEL = "test-embed-small"
DIMENSION = 8
NOW = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
TEXTS = ["refund policy", "items can be returned within 30 days", "server room"]


@pytest.fixture
def provider() -> EmbeddingProvider:
    return EmbeddingProvider(dimension=DIMENSION, api_key=KEY)


def client(provider: EmbeddingProvider, **options: Any) -> OpenAIHttpEmbedder:
    settings: dict[str, Any] = {
        "base_url": IN_PROCESS_URL,
        "model": MODEL,
        "dimension": DIMENSION,
        "api_key": SecretStr(KEY),
        "transport": provider.transport(),
        "timeout_seconds": 5.0,
        "now": lambda: NOW,
    }
    settings.update(options)
    return OpenAIHttpEmbedder(**settings)


@pytest.fixture
async def embedder(provider: EmbeddingProvider) -> AsyncIterator[OpenAIHttpEmbedder]:
    embedder = client(provider)
    yield embedder
    await embedder.aclose()


def expected(texts: list[str], dimension: int = DIMENSION) -> np.ndarray[Any, Any]:
    return HashingEmbedder(dimension).embed_sync(texts)


def lease(attempt: int = 1, max_attempts: int = 5) -> Lease:
    return Lease(
        task_id=uuid.uuid4(),
        owner="worker-1",
        lease_attempt=attempt,
        lease_until=NOW + timedelta(seconds=30),
        tenant_id="acme",
        document_id=uuid.uuid4(),
        version_number=2,
        task_type=TASK_TYPE_INDEX_VERSION,
        tier="standard",
        max_attempts=max_attempts,
    )


async def failure(embedder: OpenAIHttpEmbedder, texts: list[str] = TEXTS) -> IndexingFailed:
    with pytest.raises(IndexingFailed) as caught:
        await embedder.embed(texts)
    return caught.value


# --- answers ------------------------------------------------------------------------------------


@pytest.mark.parametrize("encoding_format", ["float", "base64"])
async def test_vectors_come_back_in_input_order(
    provider: EmbeddingProvider, encoding_format: str
) -> None:
    embedder = client(provider, encoding_format=encoding_format)
    vectors = await embedder.embed(TEXTS)
    await embedder.aclose()
    assert vectors.dtype == np.float32
    np.testing.assert_array_equal(vectors, expected(TEXTS))
    (request,) = provider.requests
    assert request.inputs == tuple(TEXTS)
    assert request.model == MODEL
    assert request.encoding_format == encoding_format
    assert request.authorized
    assert request.dimensions is None


async def test_items_are_placed_by_their_index_not_their_order(
    provider: EmbeddingProvider, embedder: OpenAIHttpEmbedder
) -> None:
    provider.inject("shuffled", times=1)
    np.testing.assert_array_equal(await embedder.embed(TEXTS), expected(TEXTS))


async def test_dimensions_are_sent_only_when_asked(provider: EmbeddingProvider) -> None:
    embedder = client(provider, dimension=4, send_dimensions=True)
    vectors = await embedder.embed(TEXTS)
    await embedder.aclose()
    np.testing.assert_array_equal(vectors, expected(TEXTS, 4))
    assert provider.requests[0].dimensions == 4


async def test_a_slow_answer_within_the_timeout_is_fine(
    provider: EmbeddingProvider, embedder: OpenAIHttpEmbedder
) -> None:
    provider.inject("delay", delay_seconds=0.05, times=1)
    np.testing.assert_array_equal(await embedder.embed(TEXTS), expected(TEXTS))


async def test_batches_are_requests_of_the_configured_size(
    provider: EmbeddingProvider, embedder: OpenAIHttpEmbedder
) -> None:
    texts = [f"chunk {i} about refunds" for i in range(7)]
    vectors = await embed_batched(embedder, texts, batch_size=3)
    np.testing.assert_array_equal(vectors, expected(texts))
    assert [request.inputs for request in provider.requests] == [
        tuple(texts[0:3]),
        tuple(texts[3:6]),
        tuple(texts[6:7]),
    ]


async def test_batches_also_respect_a_token_budget(
    provider: EmbeddingProvider, embedder: OpenAIHttpEmbedder
) -> None:
    texts = ["one two three", "four five", "six", "seven eight nine ten"]
    await embed_batched(
        embedder,
        texts,
        batch_size=10,
        max_batch_tokens=4,
        count_tokens=lambda text: len(text.split()),
    )
    assert [request.inputs for request in provider.requests] == [
        ("one two three",),
        ("four five", "six"),
        ("seven eight nine ten",),
    ]


# --- failures: code, and what the retry policy makes of it ----------------------------------


async def test_rate_limit_carries_retry_after_seconds_and_waits_at_least_that(
    provider: EmbeddingProvider, embedder: OpenAIHttpEmbedder
) -> None:
    provider.inject("rate_limit", retry_after="120", times=1)
    error = await failure(embedder)
    assert error.code == ErrorCode.EMBEDDING_RATE_LIMITED
    assert error.retry_after_seconds == 120.0
    decision = RetryPolicy().decide(
        lease(), error.code, error.message, retry_after_seconds=error.retry_after_seconds
    )
    assert decision.status is TaskStatus.RETRY_WAIT
    assert decision.delay_seconds >= 120.0
    # the fault was for one request only
    np.testing.assert_array_equal(await embedder.embed(TEXTS), expected(TEXTS))


async def test_rate_limit_retry_after_as_an_http_date(
    provider: EmbeddingProvider, embedder: OpenAIHttpEmbedder
) -> None:
    provider.inject("rate_limit", retry_after=format_datetime(NOW + timedelta(seconds=90), True))
    error = await failure(embedder)
    assert error.code == ErrorCode.EMBEDDING_RATE_LIMITED
    assert error.retry_after_seconds == 90.0
    decision = RetryPolicy().decide(
        lease(), error.code, error.message, retry_after_seconds=error.retry_after_seconds
    )
    assert decision.status is TaskStatus.RETRY_WAIT
    assert decision.delay_seconds >= 90.0


async def test_rate_limit_without_retry_after_backs_off(
    provider: EmbeddingProvider, embedder: OpenAIHttpEmbedder
) -> None:
    provider.inject("rate_limit")
    error = await failure(embedder)
    assert error.code == ErrorCode.EMBEDDING_RATE_LIMITED
    assert error.retry_after_seconds is None
    assert RetryPolicy().decide(lease(), error.code, error.message).status is (
        TaskStatus.RETRY_WAIT
    )


@pytest.mark.parametrize(
    ("fault", "code", "status"),
    [
        ({"kind": "status", "status": 503}, ErrorCode.EMBEDDING_UNAVAILABLE, TaskStatus.RETRY_WAIT),
        ({"kind": "status", "status": 500}, ErrorCode.EMBEDDING_UNAVAILABLE, TaskStatus.RETRY_WAIT),
        ({"kind": "status", "status": 408}, ErrorCode.EMBEDDING_TIMEOUT, TaskStatus.RETRY_WAIT),
        ({"kind": "status", "status": 404}, ErrorCode.EMBEDDING_RESPONSE_INVALID, TaskStatus.DEAD),
        ({"kind": "status", "status": 403}, ErrorCode.EMBEDDING_RESPONSE_INVALID, TaskStatus.DEAD),
        ({"kind": "wrong_count"}, ErrorCode.EMBEDDING_RESPONSE_INVALID, TaskStatus.DEAD),
        ({"kind": "duplicate_index"}, ErrorCode.EMBEDDING_RESPONSE_INVALID, TaskStatus.DEAD),
        ({"kind": "missing_index"}, ErrorCode.EMBEDDING_RESPONSE_INVALID, TaskStatus.DEAD),
        ({"kind": "wrong_dimension"}, ErrorCode.EMBEDDING_RESPONSE_INVALID, TaskStatus.DEAD),
        ({"kind": "nan"}, ErrorCode.EMBEDDING_RESPONSE_INVALID, TaskStatus.DEAD),
        # A proxy's page answered with 200: provider-side, retried (issue 27).
        ({"kind": "not_json"}, ErrorCode.EMBEDDING_RESPONSE_MALFORMED, TaskStatus.RETRY_WAIT),
        ({"kind": "model_changed"}, ErrorCode.EMBEDDING_MODEL_CHANGED, TaskStatus.DEAD),
    ],
)
@pytest.mark.parametrize("encoding_format", ["float", "base64"])
async def test_each_fault_maps_to_its_code_and_decision(
    provider: EmbeddingProvider,
    fault: dict[str, Any],
    code: str,
    status: TaskStatus,
    encoding_format: str,
) -> None:
    embedder = client(provider, encoding_format=encoding_format)
    provider.inject(**fault)
    error = await failure(embedder)
    await embedder.aclose()
    assert error.code == code
    assert RetryPolicy().decide(lease(), error.code, error.message).status is status


async def test_503_with_retry_after_passes_it_on(
    provider: EmbeddingProvider, embedder: OpenAIHttpEmbedder
) -> None:
    provider.inject("status", status=503, retry_after="45")
    error = await failure(embedder)
    assert (error.code, error.retry_after_seconds) == (ErrorCode.EMBEDDING_UNAVAILABLE, 45.0)


async def test_a_hung_request_times_out(provider: EmbeddingProvider) -> None:
    embedder = client(provider, timeout_seconds=0.2)
    provider.inject("hang", hang_seconds=60)
    error = await failure(embedder)
    await embedder.aclose()
    provider.clear_faults()
    assert error.code == ErrorCode.EMBEDDING_TIMEOUT
    assert RetryPolicy().decide(lease(), error.code, error.message).status is (
        TaskStatus.RETRY_WAIT
    )


async def test_a_refused_connection_is_unavailable() -> None:
    with socket.socket() as bound_not_listening:
        bound_not_listening.bind(("127.0.0.1", 0))
        port = bound_not_listening.getsockname()[1]
        embedder = OpenAIHttpEmbedder(
            base_url=f"http://127.0.0.1:{port}/v1", model=MODEL, dimension=DIMENSION
        )
        error = await failure(embedder)
        await embedder.aclose()
    assert error.code == ErrorCode.EMBEDDING_UNAVAILABLE
    assert RetryPolicy().decide(lease(), error.code, error.message).status is (
        TaskStatus.RETRY_WAIT
    )


async def test_a_wrong_key_is_terminal_and_the_key_is_never_quoted(
    provider: EmbeddingProvider,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import logging

    import structlog

    secret = "sk-client-secret-xyz-987654321"
    embedder = client(provider, api_key=SecretStr(secret))
    caplog.set_level(logging.DEBUG)
    with structlog.testing.capture_logs() as logs:
        error = await failure(embedder)
    await embedder.aclose()
    assert error.code == ErrorCode.EMBEDDING_RESPONSE_INVALID
    assert "401" in error.message
    decision = RetryPolicy().decide(lease(), error.code, error.message)
    assert decision.status is TaskStatus.DEAD
    # the provider echoed the key in its error body; nothing of ours repeats it
    assert not provider.requests[0].authorized
    captured = capsys.readouterr()
    for text in (
        str(error),
        repr(error),
        decision.error_message,
        repr(logs),
        caplog.text,
        captured.out,
        captured.err,
        repr(embedder.__dict__),
    ):
        assert secret not in text
    assert logs, "the failure is logged"


async def test_rendered_json_logs_never_carry_the_key(
    provider: EmbeddingProvider, capsys: pytest.CaptureFixture[str]
) -> None:
    import structlog

    from services.runtime.logging import configure_logging

    secret = "sk-client-secret-rendered-555"
    saved = structlog.get_config()
    configure_logging(level="debug")
    try:
        embedder = client(provider, api_key=SecretStr(secret))
        provider.inject("status", status=503, times=1)
        await failure(embedder)
        await failure(embedder)  # 401: the provider echoes the key
        await embedder.aclose()
    finally:
        structlog.configure(**saved)
    err = capsys.readouterr().err
    assert "embedding.request_failed" in err
    assert secret not in err


# --- a batch refused for one input ------------------------------------------------------------


async def test_a_batch_refused_for_one_input_is_split_until_the_input_stands_alone(
    provider: EmbeddingProvider, embedder: OpenAIHttpEmbedder
) -> None:
    provider.set_limits(Limits(max_input_chars=40))
    texts = [f"chunk {i}" for i in range(8)]
    texts[5] = "an input far longer than the provider's limit of forty characters"
    with pytest.raises(InputRefused) as caught:
        await embed_batched(embedder, texts, batch_size=4)
    refused = caught.value
    assert refused.code == ErrorCode.EMBEDDING_RESPONSE_INVALID
    assert refused.position == 5
    assert "input 5" in refused.message
    assert RetryPolicy().decide(lease(), refused.code, refused.message).status is (TaskStatus.DEAD)
    assert (
        [request.inputs for request in provider.requests]
        == [
            tuple(texts[0:4]),  # first batch fine
            tuple(texts[4:8]),  # refused
            tuple(texts[4:6]),  # refused
            tuple(texts[4:5]),  # fine
            tuple(texts[5:6]),  # refused alone
        ]
    )


async def test_a_split_batch_that_succeeds_keeps_every_row_in_place(
    provider: EmbeddingProvider, embedder: OpenAIHttpEmbedder
) -> None:
    # a whole-batch 400 the first time only: the halves then succeed
    provider.inject("bad_request", times=1)
    texts = [f"chunk {i}" for i in range(5)]
    np.testing.assert_array_equal(await embedder.embed(texts), expected(texts))
    assert [len(request.inputs) for request in provider.requests] == [5, 2, 3]


def test_a_plain_http_provider_loads_no_ca_bundle_and_would_refuse_any_certificate() -> None:
    import ssl

    from services.embedding.openai_http import _tls_verification

    for url in ("http://127.0.0.1:8080/v1", "HTTP://embeddings.internal/v1"):
        context = _tls_verification(url)
        assert isinstance(context, ssl.SSLContext)
        assert context.verify_mode == ssl.CERT_REQUIRED
        assert context.check_hostname
        assert context.get_ca_certs() == []
    assert _tls_verification("https://api.openai.com/v1") is True
