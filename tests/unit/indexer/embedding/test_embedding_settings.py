from __future__ import annotations

from pathlib import Path

import pytest

from services.embedding.factory import build_embedder
from services.embedding.hashing import HashingEmbedder
from services.embedding.onnx_local import OnnxLocalEmbedder
from services.embedding.openai_http import OpenAIHttpEmbedder
from services.embedding.settings import (
    EmbeddingSettings,
    HashingConfig,
    OnnxLocalConfig,
    OpenAIConfig,
    load_embedding_settings,
)
from services.runtime.errors import ConfigError

SECRET = "sk-live-do-not-print-4242"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("KB_EMBEDDING_"):
            monkeypatch.delenv(name)


def openai_env(monkeypatch: pytest.MonkeyPatch, **extra: str) -> None:
    values = {
        "KB_EMBEDDING_PROVIDER": "openai",
        "KB_EMBEDDING_BASE_URL": "http://127.0.0.1:9/v1/",
        "KB_EMBEDDING_MODEL": "text-embedding-3-small",
        "KB_EMBEDDING_DIMENSIONS": "512",
        "KB_EMBEDDING_API_KEY": SECRET,
        **extra,
    }
    for name, value in values.items():
        monkeypatch.setenv(name, value)


def test_the_default_is_the_local_onnx_model() -> None:
    settings = load_embedding_settings()
    assert isinstance(settings.provider, OnnxLocalConfig)
    assert settings.batch_size == 32
    assert settings.max_batch_tokens is None
    embedder = build_embedder(settings)
    assert isinstance(embedder, OnnxLocalEmbedder)
    assert (embedder.model, embedder.dimension) == ("all-MiniLM-L6-v2-onnx-int8", 384)


async def test_flat_variables_build_the_openai_provider(monkeypatch: pytest.MonkeyPatch) -> None:
    openai_env(
        monkeypatch,
        KB_EMBEDDING_BATCH_SIZE="8",
        KB_EMBEDDING_MAX_BATCH_TOKENS="4000",
        KB_EMBEDDING_TIMEOUT_SECONDS="12.5",
        KB_EMBEDDING_ENCODING_FORMAT="base64",
        KB_EMBEDDING_SEND_DIMENSIONS="true",
        KB_EMBEDDING_INTRA_OP_THREADS="4",  # another provider's: ignored
    )
    settings = load_embedding_settings()
    provider = settings.provider
    assert isinstance(provider, OpenAIConfig)
    assert provider.base_url == "http://127.0.0.1:9/v1"
    assert (provider.dimensions, provider.timeout_seconds) == (512, 12.5)
    assert provider.encoding_format == "base64"
    assert provider.send_dimensions
    assert provider.api_key is not None
    assert provider.api_key.get_secret_value() == SECRET
    assert (settings.batch_size, settings.max_batch_tokens) == (8, 4000)
    assert SECRET not in repr(settings)
    embedder = build_embedder(settings)
    assert isinstance(embedder, OpenAIHttpEmbedder)
    assert (embedder.model, embedder.dimension) == ("text-embedding-3-small", 512)
    assert embedder.tokenizer.tokenizer_file is None
    await embedder.aclose()


def test_hashing_provider(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KB_EMBEDDING_PROVIDER", "hashing")
    monkeypatch.setenv("KB_EMBEDDING_DIMENSIONS", "64")
    settings = load_embedding_settings()
    assert settings.provider == HashingConfig(dimensions=64)
    embedder = build_embedder(settings)
    assert isinstance(embedder, HashingEmbedder)
    assert embedder.model == "hashing-v1-64"


def test_settings_in_code_win_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KB_EMBEDDING_PROVIDER", "onnx-local")
    settings = EmbeddingSettings(provider=HashingConfig(dimensions=8), batch_size=4)
    assert settings.provider == HashingConfig(dimensions=8)
    assert settings.batch_size == 4


@pytest.mark.parametrize(
    ("extra", "names"),
    [
        ({"KB_EMBEDDING_DIMENSIONS": "many"}, ["KB_EMBEDDING_DIMENSIONS"]),
        ({"KB_EMBEDDING_BASE_URL": "ftp://example"}, ["KB_EMBEDDING_BASE_URL"]),
        ({"KB_EMBEDDING_MODEL": "it's"}, ["KB_EMBEDDING_MODEL"]),
        ({"KB_EMBEDDING_PROVIDER": "openia"}, ["KB_EMBEDDING_PROVIDER", "openai"]),
        ({"KB_EMBEDDING_BATCH_SIZE": "0"}, ["KB_EMBEDDING_BATCH_SIZE"]),
        ({"KB_EMBEDDING_ENCODING_FORMAT": "hex"}, ["KB_EMBEDDING_ENCODING_FORMAT"]),
    ],
)
def test_a_bad_setting_is_named_without_echoing_the_key(
    monkeypatch: pytest.MonkeyPatch, extra: dict[str, str], names: list[str]
) -> None:
    openai_env(monkeypatch, **extra)
    with pytest.raises(ConfigError) as caught:
        load_embedding_settings()
    message = str(caught.value)
    for name in names:
        assert name in message
    assert SECRET not in message


def test_a_missing_required_openai_setting_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    openai_env(monkeypatch)
    monkeypatch.delenv("KB_EMBEDDING_MODEL")
    with pytest.raises(ConfigError, match="KB_EMBEDDING_MODEL: Field required") as caught:
        load_embedding_settings()
    assert SECRET not in str(caught.value)


@pytest.mark.parametrize(
    ("ceiling", "floor"),
    [
        ("KB_EMBEDDING_RATE_MAX_PAUSE_SECONDS", "KB_EMBEDDING_RATE_DEFAULT_PAUSE_SECONDS"),
        ("KB_EMBEDDING_BREAKER_MAX_OPEN_SECONDS", "KB_EMBEDDING_BREAKER_OPEN_SECONDS"),
    ],
)
def test_a_ceiling_below_its_floor_names_both(
    monkeypatch: pytest.MonkeyPatch, ceiling: str, floor: str
) -> None:
    monkeypatch.setenv(floor, "120")
    monkeypatch.setenv(ceiling, "120")
    load_embedding_settings()  # equal is allowed
    monkeypatch.setenv(ceiling, "60")
    with pytest.raises(ConfigError) as caught:
        load_embedding_settings()
    assert caught.value.message == (
        f"invalid embedding settings: {ceiling}: Value error, must be at least {floor} (120.0)"
    )


@pytest.mark.parametrize(
    ("variables", "cores", "plan"),
    [
        ({}, {0, 1}, (1, 2, 1)),
        ({}, set(range(8)), (1, 4, 1)),
        # The former default, set: what it always meant, one run of two threads.
        ({"KB_EMBEDDING_INTRA_OP_THREADS": "2"}, {0, 1}, (2, 1, 1)),
        ({"KB_EMBEDDING_MAX_CONCURRENT_INFERENCES": "2"}, {0, 1}, (1, 1, 2)),
        ({"KB_EMBEDDING_RUNS_PER_REQUEST": "3"}, {0}, (1, 3, 1)),
        # An operator's batch of 16 a run stays one batch in memory at a time...
        ({"KB_EMBEDDING_INFERENCE_BATCH_SIZE": "16"}, set(range(8)), (1, 1, 1)),
        # ...unless they ask for more runs.
        (
            {"KB_EMBEDDING_INFERENCE_BATCH_SIZE": "16", "KB_EMBEDDING_RUNS_PER_REQUEST": "2"},
            set(range(8)),
            (1, 2, 1),
        ),
        (
            {"KB_EMBEDDING_INTRA_OP_THREADS": "2", "KB_EMBEDDING_RUNS_PER_REQUEST": "2"},
            {0, 1},
            (2, 2, 1),
        ),
    ],
)
def test_the_offline_models_runs_combine_the_settings_and_the_cores(
    monkeypatch: pytest.MonkeyPatch,
    variables: dict[str, str],
    cores: set[int],
    plan: tuple[int, int, int],
    tmp_path: Path,
) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: cores, raising=False)
    # No CPU quota: the cores are the affinity, whatever cgroup runs the tests.
    monkeypatch.setattr("services.runtime.cpus.CGROUP_ROOT", tmp_path)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    embedder = build_embedder(load_embedding_settings())
    assert isinstance(embedder, OnnxLocalEmbedder)
    made = embedder.plan
    assert (made.intra_op_threads, made.runs_per_request, made.max_concurrent_inferences) == plan


@pytest.mark.parametrize(
    ("variables", "names"),
    [
        ({"KB_EMBEDDING_RUNS_PER_REQUEST": "0"}, ["KB_EMBEDDING_RUNS_PER_REQUEST"]),
        ({"KB_EMBEDDING_RUNS_PER_REQUEST": "two"}, ["KB_EMBEDDING_RUNS_PER_REQUEST"]),
        ({"KB_EMBEDDING_INTRA_OP_THREADS": "0"}, ["KB_EMBEDDING_INTRA_OP_THREADS"]),
        (
            {
                "KB_EMBEDDING_INTRA_OP_THREADS": "16",
                "KB_EMBEDDING_MAX_CONCURRENT_INFERENCES": "32",
            },
            ["KB_EMBEDDING_INTRA_OP_THREADS (16)", "model threads at once, more than 256"],
        ),
    ],
)
def test_a_bad_combination_of_the_offline_models_runs_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch, variables: dict[str, str], names: list[str]
) -> None:
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as caught:
        load_embedding_settings()
    for name in names:
        assert name in str(caught.value)
