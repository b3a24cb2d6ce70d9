"""Indexer metrics (docs/architecture.md#observability). Labels: tier, task type, result, error
code, stage only -- never a tenant, document or task id.

Counters and histograms are observed where things happen (``WorkerMetrics`` is the worker's
observer, the pipeline times its stages); the queue's gauges come from one cheap query per
process every few seconds (``QueueGaugeSampler``), shared by all slots.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Any, Protocol

from prometheus_client import Counter, Gauge, Histogram

from services.indexer.queue.attempt import WorkerEvent
from services.runtime.logging import get_logger
from services.runtime.pg.sql import queries_beside

log = get_logger(__name__)
QUERIES = queries_beside(__file__, "metrics.sql")

_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


def _queue_gauge(name: str, documentation: str) -> Gauge:
    """One of the queue's gauges: a series per tier, set by ``QueueGaugeSampler``."""
    return Gauge(name, documentation, ["tier"])


TASKS_DUE = _queue_gauge("kb_indexer_tasks_due", "Index tasks due now (PENDING or RETRY_WAIT)")
OLDEST_DUE_AGE = _queue_gauge(
    "kb_indexer_oldest_due_task_age_seconds",
    "How long the oldest due task has been waiting for a worker (0 when none is due)",
)
TASKS_RETRY_WAITING = _queue_gauge(
    "kb_indexer_tasks_retry_waiting", "RETRY_WAIT tasks backing off (not yet due)"
)
TASKS_RUNNING = _queue_gauge("kb_indexer_tasks_running", "RUNNING index tasks (leased)")
LEASES_EXPIRING = _queue_gauge(
    "kb_indexer_leases_expiring",
    "RUNNING tasks whose lease ends within a third of the lease (a heartbeat is overdue)",
)
LEASES_EXPIRED = _queue_gauge(
    "kb_indexer_leases_expired",
    "RUNNING tasks whose lease has expired: their worker is gone; the next claim takes over",
)
TASK_RESULTS = Counter(
    "kb_indexer_task_results",
    "Attempts that ended, by result (succeeded, retry, dead, lost_lease) and error code",
    ["tier", "task_type", "result", "error_code"],
)
CLAIMED = Counter("kb_indexer_tasks_claimed", "Tasks claimed (lease generations started)", ["tier"])
CLAIMS = Counter(
    "kb_indexer_claims", "Claim statements run, by whether they found work", ["tier", "result"]
)
HEARTBEAT_SECONDS = Histogram(
    "kb_indexer_heartbeat_seconds", "Round trip of a lease heartbeat", ["tier"], buckets=_SECONDS
)
STAGE_SECONDS = Histogram(
    "kb_indexer_stage_seconds",
    "Time per pipeline stage of one task (load, parse with chunking, embed, sink)",
    ["tier", "stage"],
    buckets=_SECONDS,
)
CHUNKS_PER_TASK = Histogram(
    "kb_indexer_chunks_per_task",
    "Chunks of an indexed version, and how many of them needed the embedding provider",
    ["tier", "kind"],
    buckets=(1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 10_000),
)
EMBEDDING_BATCHES_PER_TASK = Histogram(
    "kb_indexer_embedding_batches_per_task",
    "A task's embedded chunks over the batch size, rounded up (requests are shared by tasks)",
    ["tier"],
    buckets=(0, 1, 2, 5, 10, 25, 50, 100, 250, 1000),
)
EMBEDDING_REQUEST_INPUTS = Histogram(
    "kb_indexer_embedding_request_inputs",
    "Texts in one embedding request (the requests are shared by the tasks being indexed)",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048),
)
EMBEDDING_REQUEST_DOCUMENTS = Histogram(
    "kb_indexer_embedding_request_documents",
    "Documents whose texts shared one embedding request",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128),
)
PUBLISH_TO_SEARCHABLE = Histogram(
    "kb_indexer_publish_to_searchable_seconds",
    "From a version's publish commit to the commit that made it searchable",
    ["tier"],
    buckets=(0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 2, 5, 10, 30, 60, 300, 1800, 3600),
)
HINTS_RECEIVED = Counter("kb_indexer_hints_received", "Kafka hint messages read", ["tier"])
HINT_WAKEUPS = Counter(
    "kb_indexer_hint_wakeups", "Wake-ups of the claim loop caused by hints", ["tier"]
)
HINTS_COALESCED = Counter(
    "kb_indexer_hints_coalesced", "Valid hints that rode on another hint's wake-up", ["tier"]
)
HINTS_SKIPPED = Counter(
    "kb_indexer_hints_skipped",
    "Hint messages skipped: undecodable, unknown fingerprint or type, another tier, too large",
    ["tier", "reason"],
)
HINTS_CONNECTED = Gauge(
    "kb_indexer_hints_connected",
    "1 while the hint consumer is connected to Kafka; 0 means the indexer runs on its poll "
    "timer alone (hints off, Kafka unreachable or --no-hints)",
    ["tier"],
)


class HintCounts(Protocol):
    received: int
    woke: int
    coalesced: int
    skipped: dict[str, int]
    connected: bool


class HintMetrics:
    """Turns the hint consumer's running totals into Prometheus counters."""

    def __init__(self, tier: str) -> None:
        self._tier = tier
        self._seen_received = 0
        self._seen_woke = 0
        self._seen_coalesced = 0
        self._seen_skipped: dict[str, int] = {}
        HINTS_CONNECTED.labels(tier).set(0)

    def __call__(self, stats: HintCounts) -> None:
        tier = self._tier
        HINTS_RECEIVED.labels(tier).inc(stats.received - self._seen_received)
        HINT_WAKEUPS.labels(tier).inc(stats.woke - self._seen_woke)
        HINTS_COALESCED.labels(tier).inc(stats.coalesced - self._seen_coalesced)
        for reason, count in stats.skipped.items():
            HINTS_SKIPPED.labels(tier, reason).inc(count - self._seen_skipped.get(reason, 0))
        self._seen_received, self._seen_woke = stats.received, stats.woke
        self._seen_coalesced, self._seen_skipped = stats.coalesced, dict(stats.skipped)
        HINTS_CONNECTED.labels(tier).set(1 if stats.connected else 0)


class WorkerMetrics:
    """The worker's observer: counts claims and results, times heartbeats, and remembers the
    tasks this process completed so that their publish->searchable latency is observed once
    (by the process that made the switch)."""

    def __init__(self, tier: str, task_type: str = "INDEX_VERSION") -> None:
        self._tier = tier
        self._task_type = task_type
        self.completed: list[uuid.UUID] = []

    def __call__(self, event: WorkerEvent) -> None:
        tier, task_type = self._tier, self._task_type
        if event.kind == "claimed":
            CLAIMED.labels(tier).inc()
        elif event.kind == "idle":
            CLAIMS.labels(tier, "idle").inc()
        elif event.kind == "heartbeat" and event.seconds is not None:
            HEARTBEAT_SECONDS.labels(tier).observe(event.seconds)
        elif event.kind == "completed":
            TASK_RESULTS.labels(tier, task_type, "succeeded", "").inc()
            if event.task_id is not None:
                self.completed.append(event.task_id)
        elif event.kind == "lease_lost":
            TASK_RESULTS.labels(tier, task_type, "lost_lease", "").inc()
        elif event.kind == "failed" and event.detail:
            code, _, status = event.detail.partition(" ")
            result = "retry" if status == "RETRY_WAIT" else "dead"
            TASK_RESULTS.labels(tier, task_type, result, code).inc()

    def take_completed(self) -> list[uuid.UUID]:
        taken, self.completed = self.completed, []
        return taken


class QueueGaugeSampler:
    """Refreshes the queue gauges of ``tiers`` every ``interval_seconds`` with one query,
    and observes the publish->searchable latency of the tasks ``observer`` saw complete."""

    def __init__(
        self,
        pool: Any,
        tiers: Sequence[str],
        *,
        lease_seconds: float,
        interval_seconds: float = 5.0,
        now: datetime | None = None,
        observer: WorkerMetrics | None = None,
    ) -> None:
        self._pool = pool
        self._tiers = list(tiers)
        self._expiring_within = lease_seconds / 3
        self._interval = interval_seconds
        self._now = now
        self._observer = observer

    async def sample(self) -> list[dict[str, Any]]:
        rows = await self._pool.fetch(
            QUERIES["queue_gauges"], self._tiers, self._expiring_within, self._now
        )
        for row in rows:
            tier = row["tier"]
            TASKS_DUE.labels(tier).set(row["due"])
            OLDEST_DUE_AGE.labels(tier).set(max(0.0, row["oldest_due_age_seconds"] or 0.0))
            TASKS_RETRY_WAITING.labels(tier).set(row["retry_waiting"])
            TASKS_RUNNING.labels(tier).set(row["running"])
            LEASES_EXPIRING.labels(tier).set(row["expiring"])
            LEASES_EXPIRED.labels(tier).set(row["expired"])
        await self._observe_switches()
        return [dict(row) for row in rows]

    async def _observe_switches(self) -> None:
        if self._observer is None:
            return
        completed = self._observer.take_completed()
        if not completed:
            return
        switches = await self._pool.fetch(QUERIES["publish_to_switch_of_tasks"], completed)
        for row in switches:
            PUBLISH_TO_SEARCHABLE.labels(row["tier"]).observe(max(0.0, row["seconds"]))

    async def run(self, stop: asyncio.Event) -> None:
        """Sample until ``stop``; a failed sample is logged and retried next interval."""
        while not stop.is_set():
            try:
                await self.sample()
            except Exception as error:  # metrics never take the worker down
                log.warning("metrics.sample_failed", error=f"{type(error).__name__}: {error}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self._interval)
