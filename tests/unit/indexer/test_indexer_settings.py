"""IndexerSettings: KB_INDEXER_* environment (durations in *_SECONDS), validated and frozen."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.indexer.settings import IndexerSettings
from services.runtime.settings import RuntimeSettings, env_names


def test_reads_kb_indexer_prefixed_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KB_INDEXER_LEASE_SECONDS", "2")
    monkeypatch.setenv("KB_INDEXER_CONCURRENCY", "16")
    monkeypatch.setenv("KB_INDEXER_BACKOFF_CAP_SECONDS", "120")
    monkeypatch.setenv("KB_INDEXER_POLL_SECONDS", "0.5")
    monkeypatch.setenv("KB_INDEXER_MAX_RETRY_AFTER_SECONDS", "900")
    monkeypatch.setenv("KB_INDEXER_PROVIDER_FAILURE_BUDGET_SECONDS", "7200")
    monkeypatch.setenv("KB_INDEXER_WORKER_ID", "w-7")
    monkeypatch.setenv("KB_LOG_LEVEL", "debug")  # the shared settings keep their names
    monkeypatch.setenv("DATABASE_URL", "postgresql://db.example/kb")
    settings = IndexerSettings()
    assert isinstance(settings, RuntimeSettings)
    assert (settings.indexer_lease_seconds, settings.indexer_concurrency) == (2.0, 16)
    assert settings.indexer_backoff_cap_seconds == 120
    assert settings.indexer_poll_seconds == 0.5
    assert settings.indexer_max_retry_after_seconds == 900
    assert settings.indexer_provider_failure_budget_seconds == 7200
    assert settings.indexer_worker_id == "w-7"
    assert (settings.log_level, settings.database_url) == ("debug", "postgresql://db.example/kb")
    assert settings.indexer == "pipeline"
    assert (settings.indexer_chunk_max_tokens, settings.indexer_chunk_overlap_tokens) == (256, 0)
    assert settings.indexer_hints is True
    with pytest.raises(ValidationError):
        settings.indexer_lease_seconds = 3  # type: ignore[misc]


def test_every_own_setting_is_kb_indexer_and_durations_say_seconds() -> None:
    own = env_names(IndexerSettings) - env_names(RuntimeSettings)
    # Which indexer the CLI wires in (only the pipeline) keeps its historical name.
    own -= {"KB_INDEXER"}
    assert own, "no settings of its own?"
    assert all(name.startswith("KB_INDEXER_") for name in own), own
    for name in (
        "KB_INDEXER_LEASE_SECONDS",
        "KB_INDEXER_MAX_ATTEMPTS",
        "KB_INDEXER_BACKOFF_BASE_SECONDS",
        "KB_INDEXER_BACKOFF_CAP_SECONDS",
        "KB_INDEXER_BACKOFF_JITTER",
        "KB_INDEXER_CONCURRENCY",
        "KB_INDEXER_POLL_SECONDS",
        "KB_INDEXER_GRACE_PERIOD_SECONDS",
        "KB_INDEXER_WORKER_ID",
        "KB_INDEXER_MAX_RETRY_AFTER_SECONDS",
        "KB_INDEXER_PROVIDER_FAILURE_BUDGET_SECONDS",
    ):
        assert name in own


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("KB_INDEXER_LEASE_SECONDS", "0"),
        ("KB_INDEXER_CONCURRENCY", "0"),
        ("KB_INDEXER_BACKOFF_JITTER", "1.5"),
        ("KB_INDEXER_BACKOFF_CAP_SECONDS", "0.5"),  # below the default base of 2 s
        ("KB_INDEXER_MAX_RETRY_AFTER_SECONDS", "0"),
        ("KB_INDEXER_PROVIDER_FAILURE_BUDGET_SECONDS", "0"),
        ("KB_INDEXER_PROVIDER_FAILURE_BUDGET_SECONDS", "inf"),
        ("KB_INDEXER_HEARTBEAT_POOL_SIZE", "0"),
        ("KB_INDEXER", "version-check"),  # the stand-in is gone
        ("KB_INDEXER_CHUNK_OVERLAP_TOKENS", "128"),  # not below half of the default 256
        ("KB_INDEXER_PARSE_BUDGET_SECONDS", "0"),
        ("KB_INDEXER_METRICS_PORT", "0"),
    ],
)
def test_rejects_settings_that_cannot_work(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValidationError):
        IndexerSettings()


@pytest.mark.parametrize(
    ("limit", "ok"), [(0, True), (512 * 1024 * 1024, True), (256 * 1024 * 1024, False), (1, False)]
)
def test_a_parse_memory_limit_is_off_or_leaves_room_to_parse(limit: int, ok: bool) -> None:
    if ok:
        assert IndexerSettings(indexer_parse_memory_limit_bytes=limit)
        return
    with pytest.raises(ValidationError, match="at least 536870912"):
        IndexerSettings(indexer_parse_memory_limit_bytes=limit)


def test_partition_graphs_are_off_unless_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    assert IndexerSettings().indexer_partition_graphs is False
    monkeypatch.setenv("KB_INDEXER_PARTITION_GRAPHS", "true")
    assert IndexerSettings().indexer_partition_graphs is True


@pytest.mark.parametrize(
    ("partition_graphs", "min_chunks", "warned"),
    [(False, 0, True), (True, 0, False), (False, 5_000, False), (True, 5_000, False)],
)
def test_an_indexer_that_builds_no_graph_at_all_says_so_at_start(
    partition_graphs: bool, min_chunks: int, warned: bool
) -> None:
    from structlog.testing import capture_logs

    from services.indexer.wiring import warn_without_graphs

    settings = IndexerSettings(
        indexer_partition_graphs=partition_graphs, indexer_tenant_graph_min_chunks=min_chunks
    )
    with capture_logs() as logs:
        assert warn_without_graphs(settings) is warned
    events = [entry for entry in logs if entry["event"] == "ann_index.none"]
    assert len(events) == int(warned)
    for event in events:
        assert event["log_level"] == "warning"
        assert "KB_INDEXER_PARTITION_GRAPHS" in event.values()
        assert "KB_INDEXER_TENANT_GRAPH_MIN_CHUNKS" in event.values()
