"""A policy made from its section of the settings (``section_of``): every field from the
setting of its name under the section's prefix, or given; never a silent default."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from services.embedding.guard.breaker import BreakerPolicy
from services.embedding.guard.factory import breaker_policy, guard_timing, quota_plan
from services.embedding.guard.guard import GuardTiming
from services.embedding.guard.quota import QuotaPlan
from services.embedding.settings import EmbeddingSettings
from services.indexer.retry import RetryPolicy
from services.indexer.settings import IndexerSettings
from services.indexer.wiring import build_worker
from services.publisher.ingest.pipeline import IngestPace, pace_of
from services.publisher.ingest.settings import IngestSettings
from services.runtime.settings import section_of


@dataclass(frozen=True)
class _Knobs:
    lease_seconds: float = 1.0
    unheard_of_seconds: float = 2.0


def test_a_field_without_its_setting_is_an_error_not_its_default() -> None:
    with pytest.raises(AttributeError, match="unheard_of_seconds"):
        section_of(_Knobs, IndexerSettings(), "indexer_")


def test_a_given_field_is_taken_as_given_and_the_others_from_the_section() -> None:
    settings = IndexerSettings(indexer_lease_seconds=7)
    knobs = section_of(_Knobs, settings, "indexer_", unheard_of_seconds=3.0)
    assert knobs == _Knobs(lease_seconds=7.0, unheard_of_seconds=3.0)


def test_the_guard_policies_take_every_setting_of_theirs() -> None:
    settings = EmbeddingSettings(
        rate_requests_per_second=9,
        rate_tokens_per_minute=600,
        rate_query_reserve=0.25,
        rate_tenant_share=0.5,
        rate_burst_seconds=3,
        rate_max_wait_seconds=11,
        rate_query_max_wait_seconds=2,
        rate_default_pause_seconds=4,
        rate_max_pause_seconds=40,
        breaker_failure_threshold=8,
        breaker_open_seconds=12,
        breaker_max_open_seconds=50,
        breaker_probe_seconds=70,
        guard_refresh_seconds=0.25,
    )
    assert quota_plan(settings) == QuotaPlan(
        requests_per_second=9, tokens_per_second=10, query_reserve=0.25, tenant_share=0.5,
        burst_seconds=3,
    )  # fmt: skip
    assert breaker_policy(settings) == BreakerPolicy(
        failure_threshold=8, open_seconds=12, max_open_seconds=50, probe_seconds=70
    )
    assert guard_timing(settings) == GuardTiming(
        max_wait_seconds=11, query_max_wait_seconds=2, default_pause_seconds=4,
        refresh_seconds=0.25, max_pause_seconds=40,
    )  # fmt: skip


def test_the_worker_retries_by_every_indexer_retry_setting() -> None:
    settings = IndexerSettings(
        indexer_backoff_base_seconds=3,
        indexer_backoff_cap_seconds=90,
        indexer_backoff_jitter=0.4,
        indexer_max_retry_after_seconds=120,
        indexer_provider_failure_budget_seconds=5000,
    )
    pool: Any = object()  # only kept: nothing is queried while the worker is built
    worker = build_worker(settings, pool, object(), "standard", 1)  # type: ignore[arg-type]
    assert worker.attempts.policy == RetryPolicy(
        backoff_base_seconds=3, backoff_cap_seconds=90, jitter=0.4,
        max_retry_after_seconds=120, provider_failure_budget_seconds=5000,
    )  # fmt: skip


def test_the_ingest_loop_paces_itself_by_every_ingest_setting_of_its_own() -> None:
    settings = IngestSettings(
        ingest_batch_size=70,
        ingest_poll_timeout_seconds=0.5,
        ingest_apply_batch=30,
        ingest_read_ahead=400,
        ingest_backlog_report_seconds=9,
    )
    assert pace_of(settings) == IngestPace(
        batch_size=70, poll_timeout_seconds=0.5, apply_batch=30, read_ahead=400,
        report_seconds=9,
    )  # fmt: skip
