"""Prometheus metrics of `kb ingest` (docs/metrics.md). Labels: tier, command type, result
(``applied``, ``repeated`` or a problem code), and on the backlog the tenant -- only one
whose key verified a command, never a name read from an unverified record; never a document
or command id. A tenant's backlog series is there only while it has commands waiting here
(removed when its backlog is back to none), so the series are as many as the tenants at
work, not every tenant the process has seen."""

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
            "Records of the tier's ingest topic not yet applied (nor dead-lettered) on this "
            "process's partitions: those not fetched yet (the high-water mark minus the "
            "position) and those fetched and not yet done.",
            ["tier"],
            registry=registry,
        )
        # (tier, tenant) -> commands held: the gauge's value, kept here so that the series
        # can go at none (a child of the gauge read or removed elsewhere could be stale).
        self._held: dict[tuple[str, str], int] = {}
        self.backlog = Gauge(
            "kb_ingest_backlog",
            "Commands fetched by this process and not yet applied (nor dead-lettered), by "
            "tier and tenant (tenant '-': records not verified yet).",
            ["tier", "tenant"],
            registry=registry,
        )

    def held(self, tier: str, tenant: str, records: int) -> None:
        """``records`` more commands held for the tenant (fewer: negative); at none, its
        series goes from the exposition."""
        count = self._held.get((tier, tenant), 0) + records
        if count > 0:
            self._held[(tier, tenant)] = count
            self.backlog.labels(tier, tenant).set(count)
        else:
            self._held.pop((tier, tenant), None)
            self.backlog.remove(tier, tenant)

    def backlog_of(self, tier: str, tenant: str) -> int:
        return self._held.get((tier, tenant), 0)
