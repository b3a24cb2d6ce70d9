"""The provider key: which quota an embedding provider's requests count against, as the
guard's rows and the breaker gauge name it. Two processes configured for the same endpoint
and model share one key, hence one limiter and one breaker. A key holds no secret: the
API key is not part of it, nor credentials, a query or a fragment of the URL."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

from services.embedding.settings import (
    HashingConfig,
    OnnxLocalConfig,
    OpenAIConfig,
    ProviderConfig,
)

# The model services.embedding.onnx_local runs (named here: importing it loads onnxruntime).
ONNX_LOCAL_MODEL = "all-MiniLM-L6-v2-onnx-int8"


def provider_key(provider: ProviderConfig) -> str:
    """``openai:<base_url>#<model>``, ``onnx-local:<model>`` or ``hashing:<dimensions>``."""
    if isinstance(provider, OpenAIConfig):
        return f"openai:{_public_url(provider.base_url)}#{provider.model}"
    if isinstance(provider, OnnxLocalConfig):
        return f"onnx-local:{ONNX_LOCAL_MODEL}"
    if isinstance(provider, HashingConfig):
        return f"hashing:{provider.dimensions}"
    raise AssertionError(f"unknown embedding provider {provider!r}")


def _public_url(url: str) -> str:
    """The URL without user, password, query or fragment; scheme and host lower-case."""
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme.lower(), host, parts.path.rstrip("/"), "", ""))
