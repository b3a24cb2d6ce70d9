"""An embedding provider speaking the OpenAI embeddings API over HTTP (OpenAI, vLLM, TEI,
Ollama and LiteLLM all do): ``POST {base_url}/embeddings``.

Failures map to stable codes the retry policy keys on:

- 429 -> EMBEDDING_RATE_LIMITED, with the provider's Retry-After (seconds or an HTTP date);
- a timeout (connect, or the whole request past ``timeout_seconds``), or 408 ->
  EMBEDDING_TIMEOUT;
- 5xx or a connection failure -> EMBEDDING_UNAVAILABLE (with Retry-After when sent);
- 400/413/422 for a batch -> the batch is split in halves until the refused input stands
  alone; a single refused input fails with ``InputRefused`` (EMBEDDING_RESPONSE_INVALID, its
  position in the call). Inputs are never truncated here: chunking sizes them to the model's
  limit, and an input the model still refuses is a fact an operator must see, not paper over;
- 401/403/404 and any other 4xx -> EMBEDDING_RESPONSE_INVALID: the key, the URL or the model
  is wrong, which no retry can fix (requeue the task once the configuration is fixed);
- a 200 that is no embeddings answer at all (not JSON, or no ``data`` list: a proxy's or
  gateway's page) -> EMBEDDING_RESPONSE_MALFORMED, retryable;
- a 200 whose body breaks a promise (count, indices, dimension, finite values) ->
  EMBEDDING_RESPONSE_INVALID; another model name -> EMBEDDING_MODEL_CHANGED.

The API key is a SecretStr: it is sent in the Authorization header and appears in no log
line and no error message (provider error bodies are scrubbed before they are quoted).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any, Final
from urllib.parse import urlsplit

import httpx
import numpy as np
from pydantic import SecretStr

from services.embedding.openai_wire import (
    EncodingFormat,
    parse_embeddings,
    retry_after_seconds,
)
from services.embedding.port import FixedIdentity, InputRefused, Vectors
from services.embedding.tokens import TokenizerSpec
from services.runtime.indexing.index_failures import ErrorCode, IndexingFailed, redact
from services.runtime.logging import get_logger

_log = get_logger(__name__)

# Statuses a provider answers when one input of the batch is too long (OpenAI and vLLM 400,
# TEI 413/422): worth splitting the batch to find the input.
_INPUT_REFUSED: Final = frozenset({400, 413, 422})
_DETAIL_CHARS: Final = 300


class _Refused(Exception):
    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


def _tls_verification(base_url: str) -> ssl.SSLContext | bool:
    """The CA bundle for an https:// provider. A plain http:// one never uses TLS (redirects
    are not followed), so its client gets a context that trusts no certificate instead of
    loading the bundle, which takes tens of milliseconds at the indexer's start: were a TLS
    handshake ever attempted, it would fail."""
    if urlsplit(base_url).scheme.lower() == "http":
        return ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    return True


class OpenAIHttpEmbedder(FixedIdentity):
    def __init__(
        self,
        *,
        base_url: str,
        model: str,
        dimension: int,
        send_dimensions: bool = False,
        api_key: SecretStr | None = None,
        timeout_seconds: float = 30.0,
        connect_timeout_seconds: float = 5.0,
        encoding_format: EncodingFormat = "base64",
        tokenizer: TokenizerSpec | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        super().__init__(
            model,
            dimension,
            tokenizer
            or TokenizerSpec(name="approximate", tokenizer_file=None, max_input_tokens=512),
        )
        self._base_url = base_url.rstrip("/")
        self._send_dimensions = send_dimensions
        self._api_key = api_key
        self._timeout_seconds = timeout_seconds
        self._encoding_format: EncodingFormat = encoding_format
        self._now = now
        headers = {"Accept": "application/json"}
        if api_key is not None:
            headers["Authorization"] = f"Bearer {api_key.get_secret_value()}"
        self._client = httpx.AsyncClient(
            headers=headers,
            verify=_tls_verification(self._base_url),
            # The per-read timeout alone lets a server trickling bytes hold a request forever;
            # the whole request is also bounded by timeout_seconds (see _post).
            timeout=httpx.Timeout(timeout_seconds, connect=connect_timeout_seconds),
            transport=transport,
            follow_redirects=False,
        )

    async def embed(self, texts: Sequence[str]) -> Vectors:
        """One request; more only when the provider refuses the batch for one input."""
        if not texts:
            return np.empty((0, self._dimension), dtype=np.float32)
        return await self._embed_isolating(list(texts), offset=0)

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _embed_isolating(self, texts: list[str], *, offset: int) -> Vectors:
        try:
            return await self._post(texts)
        except _Refused as refused:
            if len(texts) == 1:
                _log.warning(
                    "embedding.input_refused",
                    position=offset,
                    status=refused.status,
                    model=self._model,
                )
                raise InputRefused(
                    offset,
                    f"HTTP {refused.status}: {refused.detail} (an input longer than the model "
                    "reads, or a request setting the server rejects if every input is refused: "
                    "KB_EMBEDDING_SEND_DIMENSIONS, KB_EMBEDDING_ENCODING_FORMAT)",
                ) from None
            _log.info(
                "embedding.batch_split", size=len(texts), status=refused.status, model=self._model
            )
        middle = len(texts) // 2
        head = await self._embed_isolating(texts[:middle], offset=offset)
        tail = await self._embed_isolating(texts[middle:], offset=offset + middle)
        return np.concatenate([head, tail])

    async def _post(self, texts: list[str]) -> Vectors:
        payload: dict[str, Any] = {
            "input": texts,
            "model": self._model,
            "encoding_format": self._encoding_format,
        }
        if self._send_dimensions:
            payload["dimensions"] = self._dimension
        url = f"{self._base_url}/embeddings"
        try:
            async with asyncio.timeout(self._timeout_seconds):
                response = await self._client.post(url, json=payload)
                body = response.content
        except (TimeoutError, httpx.TimeoutException) as error:
            raise self._failed(
                ErrorCode.EMBEDDING_TIMEOUT,
                f"no embedding response within {self._timeout_seconds}s ({type(error).__name__})",
            ) from None
        except httpx.TransportError as error:
            raise self._failed(
                ErrorCode.EMBEDDING_UNAVAILABLE,
                f"embedding provider unreachable "
                f"({type(error).__name__}: {self._scrub(str(error))})",
            ) from None
        status = response.status_code
        if status == 200:
            try:
                parsed = response.json()
            except ValueError:
                raise self._failed(
                    ErrorCode.EMBEDDING_RESPONSE_MALFORMED,
                    "embedding response is not JSON (a proxy's or gateway's page?): "
                    + self._scrub(body.decode("utf-8", "replace")[:_DETAIL_CHARS]),
                ) from None
            return parse_embeddings(
                parsed,
                rows=len(texts),
                model=self._model,
                dimension=self._dimension,
                encoding_format=self._encoding_format,
            )
        detail = self._scrub(body.decode("utf-8", "replace")[:_DETAIL_CHARS])
        retry_after = retry_after_seconds(response.headers.get("retry-after"), now=self._now)
        if status == 429:
            raise self._failed(
                ErrorCode.EMBEDDING_RATE_LIMITED,
                f"embedding provider rate-limited the request (429); retry after "
                f"{retry_after if retry_after is not None else 'unspecified'}s: {detail}",
                retry_after=retry_after,
            )
        if status == 408:
            raise self._failed(ErrorCode.EMBEDDING_TIMEOUT, f"embedding provider 408: {detail}")
        if status >= 500:
            raise self._failed(
                ErrorCode.EMBEDDING_UNAVAILABLE,
                f"embedding provider failed with {status}: {detail}",
                retry_after=retry_after,
            )
        if status in _INPUT_REFUSED:
            raise _Refused(status, detail)
        # 401/403/404 and the rest: the key, the URL or the model is wrong; retrying cannot
        # help, an operator must fix the configuration and requeue.
        raise self._failed(
            ErrorCode.EMBEDDING_RESPONSE_INVALID,
            f"embedding provider refused the request with {status} (check KB_EMBEDDING_API_KEY, "
            f"KB_EMBEDDING_BASE_URL, KB_EMBEDDING_MODEL): {detail}",
        )

    def _failed(
        self, code: str, message: str, *, retry_after: float | None = None
    ) -> IndexingFailed:
        _log.warning(
            "embedding.request_failed",
            error_code=code,
            model=self._model,
            base_url=redact(self._base_url),
            retry_after_seconds=retry_after,
        )
        return IndexingFailed(code, message, retry_after_seconds=retry_after)

    def _scrub(self, text: str) -> str:
        """Provider text as it may be quoted: the API key masked even if echoed verbatim."""
        if self._api_key is not None:
            secret = self._api_key.get_secret_value()
            if secret:
                text = text.replace(secret, "***")
        return redact(text)
