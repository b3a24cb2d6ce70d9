"""Relay configuration (``KB_RELAY_*``, durations in ``*_SECONDS``), frozen once read."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from pydantic import Field, model_validator

from services.runtime.backoff import Backoff
from services.runtime.settings import RuntimeSettings

# How much of a lease a relay trusts its own clock for: it stops driving a partition well
# before the database would let another relay take it over.
LOCAL_LEASE_SHARE = 0.8

# Names the relay read before settings followed KB_<SERVICE>_*_SECONDS. Ignoring one would
# silently run with a default the operator meant to change, so a leftover is refused
# (services.runtime.settings.refuse_renamed_env).
RENAMED_ENV = {
    "KB_RELAY_LEASE_S": "KB_RELAY_LEASE_SECONDS",
    "KB_RELAY_POLL_INTERVAL_S": "KB_RELAY_POLL_INTERVAL_SECONDS",
    "KB_RELAY_PROGRESS_INTERVAL_S": "KB_RELAY_PROGRESS_INTERVAL_SECONDS",
    "KB_RELAY_BACKOFF_INITIAL_S": "KB_RELAY_BACKOFF_INITIAL_SECONDS",
    "KB_RELAY_BACKOFF_MAX_S": "KB_RELAY_BACKOFF_MAX_SECONDS",
    "KB_RELAY_SEND_TIMEOUT_S": "KB_RELAY_SEND_TIMEOUT_SECONDS",
    "KB_RELAY_RETENTION_HOURS": "KB_RELAY_RETENTION_SECONDS",
    "KB_RELAY_RETENTION_INTERVAL_S": "KB_RELAY_RETENTION_INTERVAL_SECONDS",
    "KB_RELAY_METRICS_INTERVAL_S": "KB_RELAY_METRICS_INTERVAL_SECONDS",
}


class RelaySettings(RuntimeSettings):
    renamed_env: ClassVar[Mapping[str, str]] = RENAMED_ENV

    # Lease partitions of the outbox (by hash of aggregate_key). Fixed for the life of a
    # database: the relay refuses to start when the table says otherwise.
    relay_partitions: int = Field(default=4, ge=1, le=1024)
    # How many partitions one instance drives at most; 0 = as many as are free (the first
    # instance takes all, later ones stand by and take over when a lease runs out).
    relay_max_partitions_per_instance: int = Field(default=0, ge=0)
    relay_batch_size: int = Field(default=500, ge=1, le=100_000)
    relay_poll_interval_seconds: float = Field(default=1.0, gt=0)
    # Acknowledged progress is written at most this often (0: after every batch); a crash
    # re-sends at most this much (delivery is at least once).
    relay_progress_interval_seconds: float = Field(default=0.2, ge=0)
    relay_lease_seconds: float = Field(default=10.0, gt=0)
    relay_backoff_initial_seconds: float = Field(default=0.2, gt=0)
    relay_backoff_max_seconds: float = Field(default=10.0, gt=0)
    # The most one batch may take, waiting for Kafka's acknowledgement and closing a failed
    # producer included (the sink keeps min(1 s, a quarter) of it for the close, which
    # never flushes). A relay starts a send only when it ends before its trusted lease time
    # (renewing first if need be), so this must be shorter than that share of the lease.
    relay_send_timeout_seconds: float = Field(default=5.0, gt=0)
    # Retention: delivered rows older than this (default 7 days) leave in batched deletes.
    relay_retention_seconds: float = Field(default=7 * 86_400.0, gt=0)
    relay_retention_interval_seconds: float = Field(default=300.0, gt=0)
    relay_retention_batch: int = Field(default=10_000, ge=1)
    relay_metrics_interval_seconds: float = Field(default=5.0, gt=0)
    # Optional Prometheus HTTP listener for `kb relay run` (no port: no listener). Loopback
    # by default; a scraper on another host needs KB_RELAY_METRICS_HOST set on purpose.
    relay_metrics_port: int | None = Field(default=None, ge=1, le=65535)
    relay_metrics_host: str = "127.0.0.1"
    # Topics created on start (and when first used), where the broker allows it.
    relay_create_topics: bool = True
    relay_topic_partitions: int = Field(default=3, ge=1)
    # None: the broker's default.replication.factor (a managed cluster's is 3).
    relay_topic_replication_factor: int | None = Field(default=None, ge=1)
    # Index-hint topics to create on start besides the tiers found in the tenant table.
    relay_topic_tiers: list[str] = Field(default_factory=lambda: ["standard"])

    @model_validator(mode="after")
    def _send_fits_in_lease(self) -> RelaySettings:
        if self.relay_send_timeout_seconds >= self.relay_lease_seconds * LOCAL_LEASE_SHARE:
            raise ValueError(
                f"relay_send_timeout_seconds ({self.relay_send_timeout_seconds}) must be "
                f"shorter than {LOCAL_LEASE_SHARE:.0%} of relay_lease_seconds "
                f"({self.relay_lease_seconds}): a send is only started when it ends within "
                "the lease time a relay trusts"
            )
        if self.relay_backoff_max_seconds < self.relay_backoff_initial_seconds:
            raise ValueError(
                "relay_backoff_max_seconds must not be shorter than relay_backoff_initial_seconds"
            )
        return self

    def backoff(self) -> Backoff:
        """The retry delays of the relay loop, its start-up and replay."""
        return Backoff(self.relay_backoff_initial_seconds, self.relay_backoff_max_seconds)
