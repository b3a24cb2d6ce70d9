"""Embedding profiles: several providers configured side by side by environment, and a
generation's model and dimension applied to its profile."""

from __future__ import annotations

import pytest

from services.embedding.profiles import load_profile, profile_names, settings_for_generation
from services.embedding.settings import HashingConfig, OnnxLocalConfig, OpenAIConfig
from services.index.generations import SearchGeneration
from services.runtime.errors import ConfigError

HOSTED = {
    "KB_EMBEDDING_PROFILE_HOSTED_PROVIDER": "openai",
    "KB_EMBEDDING_PROFILE_HOSTED_BASE_URL": "https://embed.example/v1/",
    "KB_EMBEDDING_PROFILE_HOSTED_MODEL": "text-embedding-3-small",
    "KB_EMBEDDING_PROFILE_HOSTED_DIMENSIONS": "1536",
    "KB_EMBEDDING_PROFILE_HOSTED_API_KEY": "sk-very-secret",
    "KB_EMBEDDING_PROFILE_HOSTED_RATE_REQUESTS_PER_SECOND": "20",
    "KB_EMBEDDING_PROFILE_LOCAL_TWO_PROVIDER": "hashing",
    "KB_EMBEDDING_BATCH_SIZE": "5",
}


def generation(profile: str, model: str, dimension: int) -> SearchGeneration:
    return SearchGeneration(
        generation_id=7,
        provider_profile=profile,
        embedding_model=model,
        dimension=dimension,
        chunk_max_tokens=256,
        chunk_overlap_tokens=32,
        chunking_settings=None,
        is_default=False,
        state="ACTIVE",
    )


def test_profiles_are_named_by_their_provider_variable() -> None:
    assert profile_names(HOSTED) == ["default", "hosted", "local_two"]
    assert profile_names({}) == ["default"]


def test_a_profile_reads_only_its_own_variables() -> None:
    hosted = load_profile("hosted", HOSTED)
    assert isinstance(hosted.provider, OpenAIConfig)
    assert hosted.provider.base_url == "https://embed.example/v1"
    assert hosted.provider.api_key is not None
    assert hosted.provider.api_key.get_secret_value() == "sk-very-secret"
    assert hosted.rate_requests_per_second == 20
    # Not the default profile's KB_EMBEDDING_BATCH_SIZE: a profile's unset fields default.
    assert hosted.batch_size == 32
    assert isinstance(load_profile("local_two", HOSTED).provider, HashingConfig)


def test_a_profile_ignores_the_processs_own_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    # The process's KB_EMBEDDING_* are the default profile's, never another profile's.
    monkeypatch.setenv("KB_EMBEDDING_PROVIDER", "hashing")
    monkeypatch.setenv("KB_EMBEDDING_BATCH_SIZE", "5")
    monkeypatch.setenv("KB_EMBEDDING_RATE_TOKENS_PER_MINUTE", "1000")
    hosted = load_profile("hosted", HOSTED)
    assert isinstance(hosted.provider, OpenAIConfig)
    assert (hosted.batch_size, hosted.rate_tokens_per_minute) == (32, None)
    assert load_profile("default", HOSTED).batch_size == 5


def test_a_profiles_ceiling_below_its_floor_is_named() -> None:
    bad = {
        **HOSTED,
        "KB_EMBEDDING_PROFILE_HOSTED_BREAKER_OPEN_SECONDS": "60",
        "KB_EMBEDDING_PROFILE_HOSTED_BREAKER_MAX_OPEN_SECONDS": "30",
    }
    with pytest.raises(ConfigError) as raised:
        load_profile("hosted", bad)
    assert raised.value.message == (
        "invalid embedding profile 'hosted': KB_EMBEDDING_PROFILE_HOSTED_BREAKER_MAX_OPEN_SECONDS:"
        " Value error, must be at least KB_EMBEDDING_BREAKER_OPEN_SECONDS (60.0)"
    )


def test_an_unknown_profile_names_the_configured_ones() -> None:
    with pytest.raises(ConfigError, match=r"KB_EMBEDDING_PROFILE_NOPE_PROVIDER.*hosted"):
        load_profile("nope", HOSTED)


def test_a_bad_variable_is_named_and_the_key_never_echoed() -> None:
    bad = {**HOSTED, "KB_EMBEDDING_PROFILE_HOSTED_DIMENSIONS": "sk-very-secret"}
    with pytest.raises(ConfigError) as raised:
        load_profile("hosted", bad)
    assert "KB_EMBEDDING_PROFILE_HOSTED_DIMENSIONS" in str(raised.value)
    assert "sk-very-secret" not in str(raised.value)


def test_a_remote_generation_brings_its_own_model_and_dimension() -> None:
    settings = settings_for_generation(generation("hosted", "text-embedding-3-large", 3072), HOSTED)
    assert isinstance(settings.provider, OpenAIConfig)
    assert (settings.provider.model, settings.provider.dimensions) == (
        "text-embedding-3-large",
        3072,
    )
    assert settings.provider.base_url == "https://embed.example/v1"


def test_a_hashing_generation_takes_its_dimension() -> None:
    settings = settings_for_generation(generation("local_two", "hashing-v1-64", 64), HOSTED)
    assert settings.provider == HashingConfig(dimensions=64)
    with pytest.raises(ConfigError, match="hashing-v1-64"):
        settings_for_generation(generation("local_two", "other-model", 64), HOSTED)


def test_the_local_model_serves_only_itself() -> None:
    from services.embedding.onnx_local import DIMENSION, MODEL_NAME

    local = {"KB_EMBEDDING_PROFILE_MINI_PROVIDER": "onnx-local"}
    settings = settings_for_generation(generation("mini", MODEL_NAME, DIMENSION), local)
    assert isinstance(settings.provider, OnnxLocalConfig)
    with pytest.raises(ConfigError, match=MODEL_NAME):
        settings_for_generation(generation("mini", MODEL_NAME, 768), local)
