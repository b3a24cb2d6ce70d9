"""How the collector of superseded chunks runs, read from ``KB_INDEX_*`` and frozen."""

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
