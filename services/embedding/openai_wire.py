"""The OpenAI embeddings wire format: reading a response body into vectors, checking every
promise it makes, and reading Retry-After.

Nothing a provider sends reaches the index unchecked: the count, every index exactly once,
the model name, the dimension and finite values.
"""

from __future__ import annotations

import base64
import binascii
import email.utils
import math
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Literal

import numpy as np

from services.embedding.port import Vectors
from services.runtime.indexing.index_failures import ErrorCode, IndexingFailed

EncodingFormat = Literal["float", "base64"]


def _invalid(message: str) -> IndexingFailed:
    return IndexingFailed(ErrorCode.EMBEDDING_RESPONSE_INVALID, message)


def malformed(message: str) -> IndexingFailed:
    """A 200 that is no embeddings answer at all (not JSON, no ``data`` list): most likely
    not the provider's own answer but a proxy's or gateway's page. Retryable, unlike an
    embeddings answer that breaks a promise (EMBEDDING_RESPONSE_INVALID)."""
    return IndexingFailed(ErrorCode.EMBEDDING_RESPONSE_MALFORMED, message)


def parse_embeddings(
    body: Any,
    *,
    rows: int,
    model: str,
    dimension: int,
    encoding_format: EncodingFormat,
) -> Vectors:
    """The vectors of a 200 answer to a request of ``rows`` inputs, row i = input i.

    A body that is not an object with a ``data`` list is EMBEDDING_RESPONSE_MALFORMED (not
    an embeddings answer: a proxy's page); an embeddings answer with a wrong count, index,
    dimension or value is EMBEDDING_RESPONSE_INVALID, another model EMBEDDING_MODEL_CHANGED."""
    if not isinstance(body, dict) or not isinstance(body.get("data"), list):
        raise malformed("embedding response is not an object with a 'data' list")
    answered_model = body.get("model")
    if answered_model != model:
        raise IndexingFailed(
            ErrorCode.EMBEDDING_MODEL_CHANGED,
            f"embedding provider answered with model {answered_model!r}, configured {model!r}; "
            "a different model needs a new index generation",
        )
    data: list[Any] = body["data"]
    if len(data) != rows:
        raise _invalid(f"embedding response has {len(data)} embeddings for {rows} inputs")
    out = np.empty((rows, dimension), dtype=np.float32)
    seen = np.zeros(rows, dtype=bool)
    for item in data:
        index = item.get("index") if isinstance(item, dict) else None
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < rows:
            raise _invalid(
                f"embedding response has an item with index {index!r}, not in 0..{rows - 1}"
            )
        if seen[index]:
            raise _invalid(f"embedding response has index {index} more than once")
        seen[index] = True
        out[index] = _vector(item.get("embedding"), index, dimension, encoding_format)
    return out


def _vector(raw: Any, index: int, dimension: int, encoding_format: EncodingFormat) -> Vectors:
    if encoding_format == "base64" and isinstance(raw, str):
        try:
            packed = base64.b64decode(raw, validate=True)
        except (binascii.Error, ValueError) as error:
            raise _invalid(f"embedding {index} is not valid base64") from error
        if len(packed) % 4:
            raise _invalid(f"embedding {index} is {len(packed)} bytes, not float32 values")
        vector = np.frombuffer(packed, dtype="<f4").astype(np.float32)
    else:
        # Asked for base64, a server that does not know the parameter answers with numbers:
        # read them as such (as the OpenAI client does). Asked for numbers, a string is
        # refused.
        if not isinstance(raw, list) or not all(
            isinstance(value, int | float) and not isinstance(value, bool) for value in raw
        ):
            raise _invalid(f"embedding {index} is not a list of numbers")
        # float32 overflow turns into inf, which the finite check below refuses.
        with np.errstate(over="ignore"):
            vector = np.asarray(raw, dtype=np.float32)
    if vector.shape != (dimension,):
        raise _invalid(f"embedding {index} has {vector.shape[0]} dimensions, expected {dimension}")
    if not np.isfinite(vector).all():
        raise _invalid(f"embedding {index} has a non-finite value")
    return vector


def encoded_vector(row: Any, encoding_format: str | None) -> str | list[float]:
    """A vector as a server writes it for a request's ``encoding_format``: little-endian
    float32 in base64 (what the OpenAI client asks for), else JSON numbers. For the servers
    this project runs itself (the demo's, the throughput bench's)."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(row, dtype="<f4").tobytes()).decode("ascii")
    values: list[float] = np.asarray(row, dtype=np.float64).tolist()
    return values


def retry_after_seconds(
    value: str | None, *, now: Callable[[], datetime] = lambda: datetime.now(UTC)
) -> float | None:
    """Retry-After as seconds from now: delta-seconds or an HTTP date (RFC 9110 §10.2.3).
    ``None`` when absent or unreadable; a date in the past is 0. Not capped here: the retry
    policy decides what to do with a long wait."""
    if value is None or not value.strip():
        return None
    text = value.strip()
    try:
        seconds = float(text)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        return max(0.0, (when - now()).total_seconds())
    if not math.isfinite(seconds) or seconds < 0:
        return None
    return seconds
