"""Which embedding provider the indexer uses, read from ``KB_EMBEDDING_*`` and frozen.

The provider is a discriminated union validated at the edge; flat environment variables
build it, so an operator writes

    KB_EMBEDDING_PROVIDER=openai                  # onnx-local (default) | openai | hashing
    KB_EMBEDDING_BASE_URL=https://api.openai.com/v1
    KB_EMBEDDING_MODEL=text-embedding-3-small
    KB_EMBEDDING_DIMENSIONS=1536
    KB_EMBEDDING_API_KEY=...

Variables that belong to another provider are ignored. ``load_embedding_settings`` turns a
bad setting into a ConfigError that names the setting and never echoes the API key.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Final, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from services.embedding.onnx_runs import plan_inference
from services.index.ann import check_model_name
from services.runtime.errors import ConfigError

ENV_PREFIX = "KB_EMBEDDING_"


class OnnxLocalConfig(BaseModel):
    """The shipped int8 all-MiniLM-L6-v2 on onnxruntime: offline, the default."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    kind: Literal["onnx-local"] = "onnx-local"
    # How these three combine, and why one-thread runs: services/embedding/onnx_runs.py.
    # onnxruntime threads inside one model run.
    intra_op_threads: int = Field(default=1, ge=1, le=64)
    # Requests embedded at once per process; more than one only helps with many spare cores.
    max_concurrent_inferences: int = Field(default=1, ge=1, le=64)
    # Texts per model run inside one request (sorted by length, padded to the longest).
    # 1 by default: a run over several texts holds the activations of all of them on top of
    # the model, and one text at a time is no slower on a small machine (no padding at all;
    # issue 9, BENCHMARKS.md).
    inference_batch_size: int = Field(default=1, ge=1, le=1024)
    # Model runs at once sharing out one request's inputs; unset: the usable cores' worth
    # (what the threads and requests leave), up to four, or one when a run takes several
    # inputs (memory). Declared last: its check reads the others.
    runs_per_request: int | None = Field(default=None, ge=1, le=64, validate_default=True)

    @field_validator("runs_per_request")
    @classmethod
    def _threads_at_once(cls, value: int | None, info: ValidationInfo) -> int | None:
        names = ("intra_op_threads", "max_concurrent_inferences", "inference_batch_size")
        others: dict[str, int] = {name: info.data[name] for name in names if name in info.data}
        if len(others) == len(names):  # else one of them failed: that error says enough
            # Checked where the process starts too (its cores may differ); here, at once.
            plan_inference(runs_per_request=value, **others)
        return value


class OpenAIConfig(BaseModel):
    """An OpenAI-compatible ``/embeddings`` endpoint (OpenAI, vLLM, TEI, Ollama, LiteLLM)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    kind: Literal["openai"] = "openai"
    # Up to and including the API version: requests go to {base_url}/embeddings.
    base_url: str
    model: str
    # The vector size the index stores: part of the index identity, so always stated.
    dimensions: int = Field(ge=1, le=16000)
    # Also send `dimensions` in each request (models that can shorten their vectors, such as
    # text-embedding-3-*); off for servers that reject the parameter.
    send_dimensions: bool = False
    api_key: SecretStr | None = None
    timeout_seconds: float = Field(default=30.0, gt=0, le=600)
    connect_timeout_seconds: float = Field(default=5.0, gt=0, le=600)
    # base64, as the OpenAI client asks: a float32 vector is a quarter of its JSON numbers'
    # size and costs both sides far less to write and read. A server that ignores the
    # parameter and answers with numbers is read all the same.
    encoding_format: Literal["float", "base64"] = "base64"
    # How chunking counts: the model's tokenizer.json when it is on this machine, else an
    # approximate count that errs high.
    tokenizer_file: str | None = None
    max_input_tokens: int = Field(default=512, ge=16, le=1_000_000)

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError("must be an http:// or https:// URL")
        return value.rstrip("/")

    @field_validator("model")
    @classmethod
    def _model_name(cls, value: str) -> str:
        return check_model_name(value)

    @field_validator("tokenizer_file")
    @classmethod
    def _existing_file(cls, value: str | None) -> str | None:
        if value is not None and not os.path.isfile(value):
            raise ValueError(f"no tokenizer file at {value}")
        return value


class HashingConfig(BaseModel):
    """The deterministic hashing stand-in: plumbing tests and chaos runs only."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    kind: Literal["hashing"] = "hashing"
    dimensions: int = Field(default=384, ge=1, le=16000)


ProviderConfig = Annotated[
    OnnxLocalConfig | OpenAIConfig | HashingConfig, Field(discriminator="kind")
]
_PROVIDERS: dict[str, type[BaseModel]] = {
    "onnx-local": OnnxLocalConfig,
    "openai": OpenAIConfig,
    "hashing": HashingConfig,
}


class _FlatProviderSource(PydanticBaseSettingsSource):
    """Builds ``provider`` from flat KB_EMBEDDING_* variables (KB_EMBEDDING_PROVIDER names the
    kind; the others fill the fields of that kind)."""

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str]) -> None:
        super().__init__(settings_cls)
        self._environ = {key.upper(): value for key, value in environ.items()}

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        kind = self._environ.get(f"{ENV_PREFIX}PROVIDER")
        config_class = _PROVIDERS.get(kind or "onnx-local")
        if config_class is None:
            # Unknown kind: let the discriminated union name the choices.
            return {"provider": {"kind": kind}}
        fields: dict[str, Any] = {"kind": kind or "onnx-local"}
        for name in config_class.model_fields:
            value = self._environ.get(f"{ENV_PREFIX}{name.upper()}")
            if value is not None and name != "kind":
                # Wrapped at once: a validation error elsewhere never shows the raw key.
                fields[name] = SecretStr(value) if name == "api_key" else value
        return {"provider": fields}


# A ceiling and the floor it may not go below; the floor is declared first, so a validator
# of the ceiling sees it validated.
_CEILINGS: Final = {
    "rate_max_pause_seconds": "rate_default_pause_seconds",
    "breaker_max_open_seconds": "breaker_open_seconds",
}


class EmbeddingSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, frozen=True, extra="ignore", populate_by_name=True
    )

    provider: ProviderConfig = Field(
        default_factory=OnnxLocalConfig,
        # Never read as one variable: _FlatProviderSource builds it from the flat ones.
        validation_alias="KB_EMBEDDING_PROVIDER_CONFIG_UNUSED",
    )
    # Texts per embedding request.
    batch_size: int = Field(default=32, ge=1, le=2048)
    # Tokens per request (providers limit both); unset: no token budget.
    max_batch_tokens: int | None = Field(default=None, ge=1)
    # The texts of every task an indexer runs at once share requests: a request that is not
    # full waits this long for more texts before it is sent anyway.
    batch_linger_seconds: float = Field(default=0.005, ge=0, le=1)
    # Requests an indexer process has outstanding at once: two keep a provider busy while
    # one answer travels back; more only queue at the provider.
    max_requests_in_flight: int = Field(default=2, ge=1, le=64)

    # --- the shared guard (services/embedding/guard/): one limiter and one breaker per
    # provider key, in PostgreSQL, shared by every process (docs/configuration.md).
    # The provider's quota; unset: that bucket is off (no rate at all: no limiter round trip).
    rate_requests_per_second: float | None = Field(default=None, gt=0)
    rate_tokens_per_minute: float | None = Field(default=None, gt=0)
    # The share of each rate indexing leaves to queries, so a backfill cannot starve search.
    rate_query_reserve: float = Field(default=0.05, ge=0, lt=1)
    # Each tenant's share of the token rate (0 < x <= 1); unset: no per-tenant share.
    rate_tenant_share: float | None = Field(default=None, gt=0, le=1)
    # How much of the rate may go at once (a bucket holds rate * this, at least one request).
    rate_burst_seconds: float = Field(default=1.0, gt=0, le=3600)
    # The longest an indexing request waits for the limiter (or a pause) before it fails
    # EMBEDDING_RATE_LIMITED; a query's, shorter: search answers from keywords instead.
    rate_max_wait_seconds: float = Field(default=30.0, ge=0, le=3600)
    rate_query_max_wait_seconds: float = Field(default=1.0, ge=0, le=3600)
    # The pause after a 429 that names no Retry-After.
    rate_default_pause_seconds: float = Field(default=1.0, gt=0, le=3600)
    # The longest pause a 429 imposes on every process; a longer Retry-After opens the
    # breaker instead, which probes after its open time (one answer cannot stop the fleet).
    rate_max_pause_seconds: float = Field(default=300.0, gt=0, le=86_400)
    # Consecutive provider failures (unavailable, timeout, malformed) that open the breaker.
    breaker_failure_threshold: int = Field(default=5, ge=1, le=10_000)
    # How long it stays open; doubled after each failed probe, up to the max. The max bounds
    # how long after a recovery the fleet goes on waiting (one probe per open period).
    breaker_open_seconds: float = Field(default=10.0, gt=0, le=86_400)
    breaker_max_open_seconds: float = Field(default=30.0, gt=0, le=86_400)
    # How long one caller holds the probe before another may probe (its owner vanished).
    breaker_probe_seconds: float = Field(default=60.0, gt=0, le=86_400)
    # How old the process's copy of the shared state may be (breaker, pause).
    guard_refresh_seconds: float = Field(default=0.5, ge=0, le=60)

    # The process's KB_EMBEDDING_* variables are the default profile's: another profile
    # (profiles.py) is read from the values it is given alone.
    reads_environment: ClassVar[bool] = True

    @field_validator(*_CEILINGS)
    @classmethod
    def _ceiling_not_below_floor(cls, value: float, info: ValidationInfo) -> float:
        floor_name = _CEILINGS[str(info.field_name)]
        floor = info.data.get(floor_name)
        if floor is not None and value < floor:
            raise ValueError(f"must be at least {ENV_PREFIX}{floor_name.upper()} ({floor})")
        return value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        if not cls.reads_environment:
            return (init_settings,)
        return init_settings, _FlatProviderSource(settings_cls, os.environ), env_settings


def load_embedding_settings(**overrides: Any) -> EmbeddingSettings:
    """The settings from the environment (and ``overrides``), or a ConfigError naming each
    bad setting by its variable, without the values (one of them may be the API key)."""
    try:
        return EmbeddingSettings(**overrides)
    except ValidationError as error:
        raise settings_error(
            error, ENV_PREFIX, "invalid embedding settings", os.environ.get(f"{ENV_PREFIX}API_KEY")
        ) from None


def settings_error(
    error: ValidationError, prefix: str, what: str, secret: str | None
) -> ConfigError:
    """A ConfigError naming each bad setting by its variable (``prefix`` + field), without
    the values, and with ``secret`` (the API key) masked wherever a message quotes it."""
    problems = []
    for item in error.errors(include_input=False, include_url=False):
        location = [str(part) for part in item["loc"] if part not in ("provider",)]
        # The union adds the kind as a location step: name only the variable.
        location = [part for part in location if part not in _PROVIDERS]
        name = f"{prefix}{location[-1].upper()}" if location else f"{prefix}PROVIDER"
        problems.append(f"{name}: {item['msg']}")
    message = f"{what}: " + "; ".join(problems)
    if secret:
        message = message.replace(secret, "***")
    return ConfigError(message)
