"""How the collector of superseded chunks runs (``KB_INDEX_*``) and how long superseded
versions' content is kept (``KB_RETENTION_*``), frozen."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class GcSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KB_INDEX_", frozen=True, extra="ignore")

    # Versions of each document kept below the one each generation serves. One keeps what a
    # revert of the last edit needs: its chunks' embeddings are reused instead of paid for
    # again. 0 keeps only what is served.
    keep_previous: int = Field(default=1, ge=0, le=1000)
    # Most chunk rows one statement deletes: a document with more is collected over several
    # short transactions, none of which holds its locks long.
    gc_batch_rows: int = Field(default=5000, ge=1, le=1_000_000)
    # How long a collector with nothing to do waits before it looks again.
    gc_interval_seconds: float = Field(default=5.0, gt=0, le=3600)


class RetentionSettings(BaseSettings):
    """How long superseded versions' content is kept, read from ``KB_RETENTION_*``
    (docs/configuration.md, docs/operations.md#retention-of-superseded-versions)."""

    model_config = SettingsConfigDict(env_prefix="KB_RETENTION_", frozen=True, extra="ignore")

    # Days a version's bytes and chunks are kept after a newer version is published, by the
    # database's clock; then they are removed and the version's row stays. 0 keeps them
    # forever. 30: a month to look at or revert to what was there before.
    superseded_days: int = Field(default=30, ge=0, le=36500)
    # Versions one batch (one transaction) takes, and chunk rows it deletes at most: a large
    # version is emptied over several short transactions.
    batch_versions: int = Field(default=100, ge=1, le=10_000)
    batch_rows: int = Field(default=5000, ge=1, le=1_000_000)
    # How often each `kb indexer run` makes a pass (and samples the lifecycle gauges).
    interval_seconds: float = Field(default=600.0, gt=0, le=86400)
