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
    # Which DocumentVersionIndexer the CLI wires in: the parse -> chunk -> embed -> pgvector
    # pipeline (services/indexer/pipeline.py); the embedding provider is configured by
    # KB_EMBEDDING_* (services/indexer/embedding/settings.py).
    indexer: Literal["pipeline"] = "pipeline"
    # Tokens per chunk, headings included; capped by what the embedding model reads.
    chunk_max_tokens: int = Field(default=256, ge=16, le=8192)
    chunk_overlap_tokens: int = Field(default=0, ge=0)
    # Wall time one document's parse + chunk may take (DOCUMENT_PARSE_TIMEOUT beyond it).
    parse_budget_seconds: float = Field(default=120.0, gt=0)
    # Processes parsing documents; by default one per slot, at most one per CPU.
    parse_workers: int | None = Field(default=None, ge=1, le=64)

    @model_validator(mode="after")
    def _cap_not_below_base(self) -> IndexerSettings:
        if self.backoff_cap_seconds < self.backoff_base_seconds:
            raise ValueError("backoff_cap_seconds must be >= backoff_base_seconds")
        if self.chunk_overlap_tokens >= self.chunk_max_tokens // 2:
            raise ValueError("chunk_overlap_tokens must be below half of chunk_max_tokens")
        return self
