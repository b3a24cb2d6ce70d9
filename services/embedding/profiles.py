"""Embedding profiles: several providers configured side by side, so that a model migration
can run while the old model still serves (docs/operations.md, "Changing the embedding
model").

``KB_EMBEDDING_*`` is the profile ``default``. Any other profile is written with the same
fields under ``KB_EMBEDDING_PROFILE_<NAME>_``:

    KB_EMBEDDING_PROFILE_HOSTED_PROVIDER=openai
    KB_EMBEDDING_PROFILE_HOSTED_BASE_URL=https://api.openai.com/v1
    KB_EMBEDDING_PROFILE_HOSTED_MODEL=text-embedding-3-small
    KB_EMBEDDING_PROFILE_HOSTED_DIMENSIONS=1536
    KB_EMBEDDING_PROFILE_HOSTED_API_KEY=...

A profile's unset fields take their defaults, not the default profile's values: its rates,
batch size and breaker belong to its own provider. A search generation names a profile and
brings its own model and dimension (``settings_for_generation``).
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Mapping
from typing import Any, Final

from pydantic import SecretStr, ValidationError

from services.embedding.settings import (
    _PROVIDERS,
    EmbeddingSettings,
    HashingConfig,
    OnnxLocalConfig,
    OpenAIConfig,
    load_embedding_settings,
    settings_error,
)
from services.index.generations import DEFAULT_PROFILE, SearchGeneration
from services.runtime.errors import ConfigError

PROFILE_PREFIX: Final = "KB_EMBEDDING_PROFILE_"
_NAME: Final = re.compile(r"^[a-z0-9][a-z0-9_]{0,31}$")
_PROVIDER_FIELDS: Final = frozenset(
    name for config in _PROVIDERS.values() for name in config.model_fields if name != "kind"
)
_SETTINGS_FIELDS: Final = frozenset(EmbeddingSettings.model_fields) - {"provider"}
_FIELDS: Final = _PROVIDER_FIELDS | _SETTINGS_FIELDS | {"provider"}


def profile_names(environ: Mapping[str, str] | None = None) -> list[str]:
    """``default`` and every profile that names its provider, sorted after it."""
    env = _upper(environ)
    named = {
        key[len(PROFILE_PREFIX) : -len("_PROVIDER")].lower()
        for key in env
        if key.startswith(PROFILE_PREFIX) and key.endswith("_PROVIDER")
    }
    named.discard(DEFAULT_PROFILE)
    return [DEFAULT_PROFILE, *sorted(name for name in named if _NAME.match(name))]


def load_profile(name: str, environ: Mapping[str, str] | None = None) -> EmbeddingSettings:
    """The settings of profile ``name``; a ConfigError when it is not configured or one of
    its variables is bad (naming the variable, never the API key's value)."""
    if name == DEFAULT_PROFILE:
        return load_embedding_settings()
    env = _upper(environ)
    if not _NAME.match(name) or f"{_prefix(name)}PROVIDER" not in env:
        raise ConfigError(
            f"no embedding profile {name!r}: set {_prefix(name)}PROVIDER (configured: "
            + ", ".join(profile_names(environ))
            + ")"
        )
    values = _profile_values(name, env)
    try:
        return _profile_settings()(**values)
    except ValidationError as error:
        raise settings_error(
            error,
            _prefix(name),
            f"invalid embedding profile {name!r}",
            env.get(f"{_prefix(name)}API_KEY"),
        ) from None


def settings_for_generation(
    generation: SearchGeneration, environ: Mapping[str, str] | None = None
) -> EmbeddingSettings:
    """The generation's profile with the generation's model and dimension: a remote
    profile is an endpoint and its credentials, the model is the generation's; a local
    model is what it is, and a generation that names another is a ConfigError."""
    settings = load_profile(generation.provider_profile, environ)
    provider = settings.provider
    model, dimension = generation.embedding_model, generation.dimension
    if isinstance(provider, OpenAIConfig):
        try:
            updated: Any = OpenAIConfig.model_validate(
                {**provider.model_dump(), "model": model, "dimensions": dimension}
            )
        except ValidationError as error:
            raise ConfigError(f"{generation.describe()}: {error.errors()[0]['msg']}") from None
    elif isinstance(provider, HashingConfig):
        if model != f"hashing-v1-{dimension}":
            raise _mismatch(generation, f"hashing-v1-{dimension}")
        updated = provider.model_copy(update={"dimensions": dimension})
    elif isinstance(provider, OnnxLocalConfig):
        from services.embedding.onnx_local import DIMENSION, MODEL_NAME

        if (model, dimension) != (MODEL_NAME, DIMENSION):
            raise _mismatch(generation, f"{MODEL_NAME} ({DIMENSION} dimensions)")
        updated = provider
    else:  # pragma: no cover - the union is closed
        raise ConfigError(f"unknown provider kind {provider!r}")
    return settings.model_copy(update={"provider": updated})


def _mismatch(generation: SearchGeneration, serves: str) -> ConfigError:
    return ConfigError(
        f"{generation.describe()} names profile {generation.provider_profile!r}, whose "
        f"provider only serves {serves}"
    )


@functools.cache
def _profile_settings() -> type[EmbeddingSettings]:
    """EmbeddingSettings read from the values given only: a profile's environment is not
    the process's KB_EMBEDDING_* (that is the default profile). Made inside a function so
    that it is not one more settings model of its own (docs/configuration.md lists the
    profile variables with EmbeddingSettings')."""

    class ProfileSettings(EmbeddingSettings):
        reads_environment = False

    return ProfileSettings


def _profile_values(name: str, env: Mapping[str, str]) -> dict[str, Any]:
    prefix = _prefix(name)
    kind = env[f"{prefix}PROVIDER"]
    config = _PROVIDERS.get(kind)
    provider: dict[str, Any] = {"kind": kind}
    values: dict[str, Any] = {}
    for key, value in env.items():
        if not key.startswith(prefix):
            continue
        field = key[len(prefix) :].lower()
        if field not in _FIELDS or field == "provider":
            continue
        if field in _SETTINGS_FIELDS:
            values[field] = value
        elif config is not None and field in config.model_fields:
            provider[field] = SecretStr(value) if field == "api_key" else value
    values["provider"] = provider
    return values


def _prefix(name: str) -> str:
    return f"{PROFILE_PREFIX}{name.upper()}_"


def _upper(environ: Mapping[str, str] | None) -> dict[str, str]:
    source = os.environ if environ is None else environ
    return {key.upper(): value for key, value in source.items()}
