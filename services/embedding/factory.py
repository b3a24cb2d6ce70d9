"""The embedder the settings ask for."""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.embedding.hashing import HashingEmbedder
from services.embedding.port import Embedder
from services.embedding.settings import (
    EmbeddingSettings,
    HashingConfig,
    OnnxLocalConfig,
    OpenAIConfig,
)
from services.embedding.tokens import TokenizerSpec

if TYPE_CHECKING:
    import httpx


def build_embedder(
    settings: EmbeddingSettings, *, transport: httpx.AsyncBaseTransport | None = None
) -> Embedder:
    """``transport`` replaces the network for the HTTP provider (tests: httpx.ASGITransport).

    Each provider's module is imported only when it is the one asked for: the ONNX runtime
    and the HTTP client take long to import, and `kb indexer run` claims before either is
    needed."""
    provider = settings.provider
    if isinstance(provider, OnnxLocalConfig):
        from services.embedding.onnx_local import OnnxLocalEmbedder

        # The config's fields, but its kind, are the embedder's keyword arguments.
        return OnnxLocalEmbedder(**provider.model_dump(exclude={"kind"}))
    if isinstance(provider, OpenAIConfig):
        from services.embedding.openai_http import OpenAIHttpEmbedder

        return OpenAIHttpEmbedder(
            base_url=provider.base_url,
            model=provider.model,
            dimension=provider.dimensions,
            send_dimensions=provider.send_dimensions,
            api_key=provider.api_key,
            timeout_seconds=provider.timeout_seconds,
            connect_timeout_seconds=provider.connect_timeout_seconds,
            encoding_format=provider.encoding_format,
            tokenizer=TokenizerSpec(
                name=provider.model if provider.tokenizer_file else "approximate",
                tokenizer_file=provider.tokenizer_file,
                max_input_tokens=provider.max_input_tokens,
            ),
            transport=transport,
        )
    if isinstance(provider, HashingConfig):
        return HashingEmbedder(provider.dimensions)
    raise AssertionError(f"unknown embedding provider {provider!r}")
