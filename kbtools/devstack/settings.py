from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


def _default_cache() -> Path:
    import os

    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kb-pipeline"


class DevStackSettings(BaseSettings):
    """Where and how the local services run. Ports are fixed (not random) so that the
    printed URLs stay valid across `up`/`down` and match the services' defaults; they lie
    below the kernel's ephemeral range (Linux: 32768-60999), from which the local ends of
    client connections are taken: a port in it may be held by any connection while a
    server is down, and the server then cannot start again ("address already in use")."""

    model_config = SettingsConfigDict(env_prefix="KB_DEV_", frozen=True, extra="ignore")

    home: Path = Field(default_factory=lambda: Path.cwd() / ".kb" / "dev")
    cache_dir: Path = Field(default_factory=_default_cache)
    pg_port: int = Field(default=25432, ge=1, le=65535)
    pg_database: str = "kb"
    # The first streaming replica's port (`kb dev up --replicas N`); replica i listens on
    # this + i - 1.
    pg_replica_port: int = Field(default=25442, ge=1, le=65535)
    # PostgreSQL's buffer cache. Small by default (the dev stack shares a laptop with the
    # tests); a large search benchmark wants the index in it (BENCHMARKS.md).
    pg_shared_buffers: str = Field(default="128MB", pattern=r"^[0-9]+(kB|MB|GB)$")
    kafka_port: int = Field(default=29092, ge=1, le=65535)
    kafka_controller_port: int = Field(default=29093, ge=1, le=65535)
    kafka_version: str = "4.1.1"
    kafka_heap_mb: int = Field(default=512, ge=128)
    start_timeout_s: float = Field(default=120.0, gt=0)

    @property
    def pg_dir(self) -> Path:
        return self.home / "postgres"

    @property
    def kafka_dir(self) -> Path:
        return self.home / "kafka"
