"""Settings of `kb ingest` (``KB_INGEST_*``): docs/configuration.md."""

from __future__ import annotations

from pydantic import Field

from services.publisher.settings import MIB, PublisherSettings


class IngestSettings(PublisherSettings):
    # A record larger than this goes to the dead-letter topic unread (INGEST_COMMAND_TOO_LARGE).
    ingest_max_command_bytes: int = Field(default=1 * MIB, ge=1024, le=64 * MIB)
    # Inline content of a PublishDocument; larger content is uploaded through the API and
    # named by reference. Kept under Kafka's default message size (1 MiB) with the envelope.
    ingest_max_inline_bytes: int = Field(default=900 * 1024, ge=1, le=64 * MIB)
    # Records read at once (one getmany), at most: the loop reads again while they apply.
    ingest_batch_size: int = Field(default=500, ge=1, le=10_000)
    # Most commands of one tenant applied in one transaction (each in a savepoint of its
    # own): fewer commits per command. As many as the bulk endpoint's batch writes at once.
    ingest_apply_batch: int = Field(default=500, ge=1, le=10_000)
    # Most records fetched and not yet applied (nor dead-lettered): reading goes on while
    # commands apply, so a tenant's commands behind another's flood on a partition apply
    # without waiting for it (only their offsets wait, committed as a prefix).
    ingest_read_ahead: int = Field(default=1000, ge=1, le=100_000)
    # How often a process writes what it holds per tenant for the operator page.
    ingest_backlog_report_seconds: float = Field(default=5.0, gt=0, le=60)
    # A tenant's ingest key is trusted this long once read: a revoked key is accepted at
    # most this long after its revocation (0: read the keys for every run of commands).
    ingest_key_cache_seconds: float = Field(default=10.0, ge=0, le=300)
    # Days a refused command's record (ingest_refusal: its dead letter sent) is kept, by the
    # database's clock; 0 keeps them forever. A record is only read again while its topic
    # still holds it, so this must stay above the ingest topics' retention.ms + segment.ms
    # (whole segments go; Kafka's defaults: 7 + 7 days), and be 0 for a topic kept forever:
    # a command redelivered after its record went would be dead-lettered a second time.
    ingest_refusal_retention_days: int = Field(default=30, ge=0, le=36500)
    # Days an applied command's record (ingest_command: what keeps a redelivered command
    # from applying twice) is kept, by the database's clock; 0 keeps them forever. The same
    # rule: above the ingest and dead-letter topics' retention.ms + segment.ms, 0 for a
    # topic kept forever, or a command read again after its record went applies again.
    ingest_command_retention_days: int = Field(default=30, ge=0, le=36500)
    ingest_poll_timeout_seconds: float = Field(default=1.0, gt=0, le=60)
    # Commands of one tenant applied at once across the batch's partitions: a tenant
    # flooding the topic holds at most this many of the process's transactions.
    ingest_tenant_in_flight: int = Field(default=4, ge=1, le=1000)
    # A transient failure (database or Kafka away) is retried after these delays; the
    # record is never skipped.
    ingest_backoff_initial_seconds: float = Field(default=0.2, gt=0)
    ingest_backoff_max_seconds: float = Field(default=10.0, gt=0)
    # The tier's ingest and dead-letter topics are created on start where the broker
    # allows, with this many partitions (a tier's consumers share at most that many).
    ingest_create_topics: bool = True
    ingest_topic_partitions: int = Field(default=6, ge=1)
    # Optional Prometheus listener of `kb ingest run` (no port: none), loopback by default.
    ingest_metrics_host: str = "127.0.0.1"
    ingest_metrics_port: int | None = Field(default=None, ge=1, le=65535)
