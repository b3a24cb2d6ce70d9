"""What the indexer reads from the environment (``KB_*``), frozen once read."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from services.runtime.settings import RuntimeSettings


class IndexerSettings(RuntimeSettings):
    # A lease outlives two missed heartbeats (they run every lease/3).
    lease_seconds: float = Field(default=30.0, gt=0)
    # The attempt budget granted by `kb tasks requeue --reset-attempts`; a task's own budget
    # is its `max_attempts` column, set when the task is created.
    max_attempts: int = Field(default=8, ge=1)
    backoff_base_seconds: float = Field(default=2.0, gt=0)
    backoff_cap_seconds: float = Field(default=600.0, gt=0)
    backoff_jitter: float = Field(default=0.2, ge=0, le=1)
    concurrency: int = Field(default=4, ge=1, le=256)
    # An idle loop polls at most this far apart even when no Kafka hint arrives.
    poll_interval_seconds: float = Field(default=5.0, gt=0)
    idle_backoff_min_seconds: float = Field(default=0.05, gt=0)
    # After SIGTERM: how long running tasks may take before they are cancelled.
    grace_period_seconds: float = Field(default=30.0, ge=0)
    # Unique per process by default (host:pid:random), so a restart is a new owner.
    worker_id: str | None = None
    # Which DocumentVersionIndexer the CLI wires in. "version-check" is the stand-in until the
    # real pipeline lands (see services/indexer/version_check.py). "test-only-hang" exists for
    # the crash tests only: it hangs on every lease generation <= test_only_hang_generations,
    # then behaves like "version-check".
    indexer: Literal["version-check", "test-only-hang"] = "version-check"
    test_only_hang_generations: int = Field(default=1, ge=0)

    @model_validator(mode="after")
    def _cap_not_below_base(self) -> IndexerSettings:
        if self.backoff_cap_seconds < self.backoff_base_seconds:
            raise ValueError("backoff_cap_seconds must be >= backoff_base_seconds")
        return self
