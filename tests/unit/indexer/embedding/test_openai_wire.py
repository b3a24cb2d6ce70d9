from __future__ import annotations

import base64
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pytest

from services.embedding.openai_wire import encoded_vector, parse_embeddings, retry_after_seconds
from services.indexer.task import ErrorCode, IndexingFailed

NOW = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)


def body(data: list[dict[str, Any]], model: str = "m") -> dict[str, Any]:
    return {"object": "list", "data": data, "model": model}


def item(index: Any, embedding: Any) -> dict[str, Any]:
    return {"object": "embedding", "index": index, "embedding": embedding}


def test_base64_is_little_endian_float32() -> None:
    vector = np.array([1.5, -2.25, 3.0], dtype="<f4")
    encoded = base64.b64encode(vector.tobytes()).decode()
    parsed = parse_embeddings(
        body([item(0, encoded)]), rows=1, model="m", dimension=3, encoding_format="base64"
    )
    np.testing.assert_array_equal(parsed[0], vector)


@pytest.mark.parametrize(
    "answer",
    [
        [],  # not an object
        "<html>gateway</html>",
        {"data": "x", "model": "m"},
        {"error": {"message": "upstream timed out"}},  # no data list
    ],
)
def test_an_answer_without_a_data_list_is_malformed_not_invalid(answer: Any) -> None:
    """Not an embeddings answer at all (a proxy's page): retryable, unlike a broken one."""
    with pytest.raises(IndexingFailed) as caught:
        parse_embeddings(answer, rows=1, model="m", dimension=2, encoding_format="float")
    assert caught.value.code == ErrorCode.EMBEDDING_RESPONSE_MALFORMED
    assert caught.value.retriable


@pytest.mark.parametrize(
    ("answer", "encoding"),
    [
        (body([item(True, [1.0, 2.0])]), "float"),  # a bool is not an index
        (body([item("0", [1.0, 2.0])]), "float"),
        (body([item(0, [1.0, "2"])]), "float"),
        (body([item(0, [1.0, 1e39])]), "float"),  # beyond float32: inf
        (body([item(0, [1.0, float("inf")])]), "float"),
        (body([item(0, "!!!not base64")]), "base64"),
        (body([item(0, base64.b64encode(b"12345").decode())]), "base64"),  # not 4-byte values
        (body([item(0, base64.b64encode(b"12345678").decode())]), "float"),  # not numbers
    ],
)
def test_broken_answers_are_invalid(answer: Any, encoding: Any) -> None:
    with pytest.raises(IndexingFailed) as caught:
        parse_embeddings(answer, rows=1, model="m", dimension=2, encoding_format=encoding)
    assert caught.value.code == ErrorCode.EMBEDDING_RESPONSE_INVALID


def test_numbers_where_base64_was_asked_for_are_read_as_numbers() -> None:
    # A server that does not know encoding_format answers with numbers, as to any request.
    vectors = parse_embeddings(
        body([item(0, [1.0, 2.0])]), rows=1, model="m", dimension=2, encoding_format="base64"
    )
    assert vectors.tolist() == [[1.0, 2.0]]


def test_a_missing_model_name_is_a_changed_model() -> None:
    with pytest.raises(IndexingFailed) as caught:
        parse_embeddings(
            {"data": [item(0, [1.0, 2.0])]}, rows=1, model="m", dimension=2, encoding_format="float"
        )
    assert caught.value.code == ErrorCode.EMBEDDING_MODEL_CHANGED


@pytest.mark.parametrize(
    ("header", "seconds"),
    [
        (None, None),
        ("", None),
        ("30", 30.0),
        (" 1.5 ", 1.5),
        ("-4", None),
        ("soon", None),
        ("Wed, 02 Dec 2026 12:01:00 GMT", 60.0),
        ("Wed, 02 Dec 2026 11:00:00 GMT", 0.0),  # in the past: now
        ("Wednesday, 02-Dec-26 12:00:30 GMT", 30.0),  # the obsolete RFC 850 form
    ],
)
def test_retry_after_seconds_or_http_date(header: str | None, seconds: float | None) -> None:
    assert retry_after_seconds(header, now=lambda: NOW) == seconds


@pytest.mark.parametrize("encoding", ["float", "base64"])
def test_what_our_servers_write_is_read_back_as_written(encoding: Any) -> None:
    vector = [0.25, -1.5, 3.0e-8]
    answer = body([item(0, encoded_vector(vector, encoding))])
    read = parse_embeddings(answer, rows=1, model="m", dimension=3, encoding_format=encoding)
    assert read.tolist() == [[float(np.float32(value)) for value in vector]]
