"""Relay configuration (``KB_RELAY_*``), frozen once read."""

from __future__ import annotations

from pydantic import Field, model_validator

from services.runtime.settings import RuntimeSettings

INDEX_HINTS_TOPIC = "kb.index-hints."
DOCUMENT_EVENTS_TOPIC = "kb.document-events"
INDEX_TASK_CREATED = "IndexTaskCreated"
# How much of a lease a relay trusts its own clock for: it stops driving a partition well
# before the database would let another relay take it over.
LOCAL_LEASE_SHARE = 0.8


class RelaySettings(RuntimeSettings):
    # Lease partitions of the outbox (by hash of aggregate_key). Fixed for the life of a
    # database: the relay refuses to start when the table says otherwise.
    relay_partitions: int = Field(default=4, ge=1, le=1024)
    # How many partitions one instance drives at most; 0 = as many as are free (the first
    # instance takes all, later ones stand by and take over when a lease runs out).
    relay_max_partitions_per_instance: int = Field(default=0, ge=0)
    relay_batch_size: int = Field(default=500, ge=1, le=100_000)
    relay_poll_interval_s: float = Field(default=1.0, gt=0)
    # Acknowledged progress is written at most this often (0: after every batch); a crash
    # re-sends at most this much (delivery is at least once).
    relay_progress_interval_s: float = Field(default=0.2, ge=0)
    relay_lease_s: float = Field(default=10.0, gt=0)
    relay_backoff_initial_s: float = Field(default=0.2, gt=0)
    relay_backoff_max_s: float = Field(default=10.0, gt=0)
    # The most one batch may take, waiting for Kafka's acknowledgement and closing a failed
    # producer included (the sink keeps min(1 s, a quarter) of it for the close, which
    # never flushes). A relay starts a send only when it ends before its trusted lease time
    # (renewing first if need be), so this must be shorter than that share of the lease.
    relay_send_timeout_s: float = Field(default=5.0, gt=0)
    # Retention: delivered rows older than this leave in batched deletes.
    relay_retention_hours: float = Field(default=168.0, gt=0)
    relay_retention_interval_s: float = Field(default=300.0, gt=0)
    relay_retention_batch: int = Field(default=10_000, ge=1)
    relay_metrics_interval_s: float = Field(default=5.0, gt=0)
    # Optional Prometheus HTTP port for `kb relay run` (unset: no listener).
    relay_metrics_port: int | None = Field(default=None, ge=1, le=65535)
    # Topics created on start (and when first used), where the broker allows it.
    relay_create_topics: bool = True
    relay_topic_partitions: int = Field(default=3, ge=1)
    relay_topic_replication_factor: int = Field(default=1, ge=1)
    # Index-hint topics to create on start besides the tiers found in the tenant table.
    relay_topic_tiers: list[str] = Field(default_factory=lambda: ["standard"])

    @model_validator(mode="after")
    def _send_fits_in_lease(self) -> RelaySettings:
        if self.relay_send_timeout_s >= self.relay_lease_s * LOCAL_LEASE_SHARE:
            raise ValueError(
                f"relay_send_timeout_s ({self.relay_send_timeout_s}) must be shorter than "
                f"{LOCAL_LEASE_SHARE:.0%} of relay_lease_s ({self.relay_lease_s}): a send "
                "is only started when it ends within the lease time a relay trusts"
            )
        return self

    def topic_for(self, event_type: str, tier: str) -> str:
        """Index hints go to their tier's topic; every other event is a lifecycle event."""
        if event_type == INDEX_TASK_CREATED:
            return self.topic(INDEX_HINTS_TOPIC + tier)
        return self.topic(DOCUMENT_EVENTS_TOPIC)
