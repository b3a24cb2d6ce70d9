"""Publisher settings: KB_PUBLISHER_* names, durations in *_SECONDS, the old name kept."""

from __future__ import annotations

import pytest

from services.publisher.settings import PublisherSettings
from services.runtime.settings import env_names


def test_publisher_settings_are_named_for_the_service() -> None:
    own = {n for n in env_names(PublisherSettings) if n.startswith("KB_PUBLISHER_")}
    assert {
        "KB_PUBLISHER_MAX_UPLOAD_BYTES",
        "KB_PUBLISHER_MAX_INFLIGHT_UPLOAD_BYTES",
        "KB_PUBLISHER_MAX_JSON_BODY_BYTES",
        "KB_PUBLISHER_DB_ACQUIRE_TIMEOUT_SECONDS",
        "KB_PUBLISHER_BODY_READ_TIMEOUT_SECONDS",
        "KB_PUBLISHER_READINESS_CACHE_SECONDS",
        "KB_PUBLISHER_KEEP_ALIVE_SECONDS",
    } <= own
    assert not any(n.endswith("_S") for n in env_names(PublisherSettings))


def test_environment_names_and_the_deprecated_upload_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KB_PUBLISHER_DB_ACQUIRE_TIMEOUT_SECONDS", "2.5")
    monkeypatch.setenv("KB_MAX_UPLOAD_BYTES", "1000")
    settings = PublisherSettings()
    assert settings.publisher_db_acquire_timeout_seconds == 2.5
    assert settings.publisher_max_upload_bytes == 1000
    monkeypatch.setenv("KB_PUBLISHER_MAX_UPLOAD_BYTES", "2000")
    assert PublisherSettings().publisher_max_upload_bytes == 2000
