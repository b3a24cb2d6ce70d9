"""Relay metrics. Labels stay low-cardinality: never a tenant, document or event id."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

BACKLOG_ROWS = Gauge(
    "kb_relay_backlog_rows",
    "Committed outbox rows not yet acknowledged by Kafka (NaN: unknown, a partition is refused)",
)
OLDEST_UNDELIVERED_AGE = Gauge(
    "kb_relay_oldest_undelivered_age_seconds",
    "Age of the oldest undelivered outbox row (NaN: unknown, a partition is refused)",
)
REFUSED_PARTITIONS = Gauge(
    "kb_relay_refused_partitions",
    "Outbox partitions whose progress belongs to another PostgreSQL cluster: not driven "
    "until re-seeded (docs/operations.md: 'Re-seeding the relay')",
)
SEND_LATENCY = Histogram(
    "kb_relay_send_latency_seconds",
    "From handing a batch to the producer to Kafka acknowledging all of it",
    ["replay"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
BATCH_SIZE = Histogram(
    "kb_relay_batch_size",
    "Events per batch sent",
    ["replay"],
    buckets=(1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000),
)
EVENTS_SENT = Counter("kb_relay_events_sent", "Events acknowledged by Kafka", ["replay"])
SEND_FAILURES = Counter("kb_relay_send_failures", "Batches Kafka did not acknowledge", ["code"])
LEASE_CHANGES = Counter(
    "kb_relay_lease_changes", "Partition leases acquired, released or lost", ["change"]
)
LIVE_INSTANCES = Gauge(
    "kb_relay_live_instances", "Relay instances holding a live lease (this one included)"
)
UNCOVERABLE_PARTITIONS = Gauge(
    "kb_relay_uncoverable_partitions",
    "Outbox partitions the live instances cannot drive at KB_RELAY_MAX_PARTITIONS_PER_INSTANCE "
    "(their rows wait until another instance starts)",
)
LEASES_HELD = Gauge("kb_relay_leases_held", "Outbox partitions this instance drives")
RETENTION_DELETED = Counter("kb_relay_retention_deleted_rows", "Delivered rows removed")
REPLAY_TOTAL = Gauge("kb_relay_replay_total_events", "Events the running replay will send")
REPLAY_SENT = Gauge("kb_relay_replay_sent_events", "Events the running replay has sent")
