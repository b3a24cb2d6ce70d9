"""IndexerSettings: KB_* environment, validated and frozen."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.indexer.settings import IndexerSettings
from services.runtime.settings import RuntimeSettings


def test_reads_kb_prefixed_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KB_LEASE_SECONDS", "2")
    monkeypatch.setenv("KB_CONCURRENCY", "16")
    monkeypatch.setenv("KB_BACKOFF_CAP_SECONDS", "120")
    settings = IndexerSettings()
    assert isinstance(settings, RuntimeSettings)
    assert (settings.lease_seconds, settings.concurrency) == (2.0, 16)
    assert settings.backoff_cap_seconds == 120
    assert settings.indexer == "pipeline"
    assert (settings.chunk_max_tokens, settings.chunk_overlap_tokens) == (256, 0)
    with pytest.raises(ValidationError):
        settings.lease_seconds = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("KB_LEASE_SECONDS", "0"),
        ("KB_CONCURRENCY", "0"),
        ("KB_BACKOFF_JITTER", "1.5"),
        ("KB_BACKOFF_CAP_SECONDS", "0.5"),  # below the default base of 2 s
        ("KB_INDEXER", "version-check"),  # the stand-in is gone
        ("KB_CHUNK_OVERLAP_TOKENS", "128"),  # not below half of the default 256 max tokens
        ("KB_PARSE_BUDGET_SECONDS", "0"),
    ],
)
def test_rejects_settings_that_cannot_work(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValidationError):
        IndexerSettings()
