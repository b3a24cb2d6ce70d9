"""Prometheus metrics of `kb ingest` (docs/metrics.md). Labels are low-cardinality only:
tier, command type, result (``applied``, ``repeated`` or a problem code); never a tenant,
document or command id."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge


class IngestMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        registry = registry if registry is not None else REGISTRY
        self.commands = Counter(
            "kb_ingest_commands",
            "Ingest commands handled, by tier, command type and result: applied, repeated "
            "(a redelivery, nothing written) or the problem code of a dead letter.",
            ["tier", "command_type", "result"],
            registry=registry,
        )
        self.dead_letters = Counter(
            "kb_ingest_dead_letters",
            "Ingest records sent to the tier's dead-letter topic, by problem code.",
            ["tier", "code"],
            registry=registry,
        )
        self.retries = Counter(
            "kb_ingest_retries",
            "Transient failures (database or Kafka away) on which a record was retried.",
            ["tier", "code"],
            registry=registry,
        )
        self.lag = Gauge(
            "kb_ingest_lag_records",
            "Records of the tier's ingest topic not yet applied by this process's partitions "
            "(the high-water mark minus the position, summed over its partitions).",
            ["tier"],
            registry=registry,
        )
