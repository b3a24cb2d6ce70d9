"""What the indexer reads from the environment, frozen once read.

The indexer's own settings are ``KB_INDEXER_*``, durations in ``*_SECONDS``; the shared ones
(``DATABASE_URL``, ``KB_LOG_LEVEL``, ``KB_DB_POOL_*``, ...) come from ``RuntimeSettings``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from services.runtime.settings import RuntimeSettings

# Names the indexer read before its settings followed KB_INDEXER_*_SECONDS. Ignoring one
# would silently run with a default the operator meant to change, so a leftover is refused
# (services.runtime.settings.refuse_renamed_env).
RENAMED_ENV = {
    "KB_LEASE_SECONDS": "KB_INDEXER_LEASE_SECONDS",
    "KB_MAX_ATTEMPTS": "KB_INDEXER_MAX_ATTEMPTS",
    "KB_BACKOFF_BASE_SECONDS": "KB_INDEXER_BACKOFF_BASE_SECONDS",
    "KB_BACKOFF_CAP_SECONDS": "KB_INDEXER_BACKOFF_CAP_SECONDS",
    "KB_BACKOFF_JITTER": "KB_INDEXER_BACKOFF_JITTER",
    "KB_CONCURRENCY": "KB_INDEXER_CONCURRENCY",
    "KB_POLL_INTERVAL_SECONDS": "KB_INDEXER_POLL_SECONDS",
    "KB_IDLE_BACKOFF_MIN_SECONDS": "KB_INDEXER_IDLE_BACKOFF_MIN_SECONDS",
    "KB_GRACE_PERIOD_SECONDS": "KB_INDEXER_GRACE_PERIOD_SECONDS",
    "KB_WORKER_ID": "KB_INDEXER_WORKER_ID",
}


class IndexerSettings(RuntimeSettings):
    renamed_env: ClassVar[Mapping[str, str]] = RENAMED_ENV

    # Field names carry the service's prefix (env prefix KB_ + indexer_...): a class-wide
    # env_prefix of KB_INDEXER_ would also rename the inherited shared settings.

    # A lease outlives two missed heartbeats (they run every lease/3).
    indexer_lease_seconds: float = Field(default=30.0, gt=0)
    # The attempt budget granted by `kb tasks requeue --reset-attempts`; a task's own budget
    # is its `max_attempts` column, set when the task is created.
    indexer_max_attempts: int = Field(default=8, ge=1)
    indexer_backoff_base_seconds: float = Field(default=2.0, gt=0)
    indexer_backoff_cap_seconds: float = Field(default=600.0, gt=0)
    indexer_backoff_jitter: float = Field(default=0.2, ge=0, le=1)
    # The longest Retry-After a retriable failure other than a provider-side one waits for
    # (default: the backoff cap); a longer one ends the task DEAD with its code. Provider-side
    # failures follow the time budget below instead.
    indexer_max_retry_after_seconds: float | None = Field(default=None, gt=0)
    # Provider-side failures (rate limited, timeout, unavailable, a malformed answer) retry
    # for this long from a task's first one, spending no attempt, then end it DEAD; a longer
    # Retry-After parks the task in RETRY_WAIT until the end of it.
    indexer_provider_failure_budget_seconds: float = Field(default=86_400.0, gt=0, lt=1e9)
    # Tasks a process indexes at once. Their chunks share embedding requests and their
    # results share commits, so a process indexing short documents needs enough of them to
    # fill both, and for a group to be indexed while another commits (BENCHMARKS.md,
    # issue 26). Each may hold its document's bytes while it waits for a parse process.
    indexer_concurrency: int = Field(default=64, ge=1, le=256)
    # Groups of completions committing at once, each on a connection of its own
    # (services/indexer/queue/completions.py).
    indexer_committing_groups: int = Field(default=2, ge=1, le=8)
    # How long a finished task keeps its lease while its result waits to be written (queued
    # behind other groups, or committing). Past it the heartbeat stops and the lease lapses:
    # a completion still queued is withdrawn and the task is done again by whoever takes it
    # over; a group finds a connection within it or fails. A wedged committer then holds
    # no lease for ever. Unset: four leases; not below one (the lease lasts that long anyway).
    indexer_completion_max_wait_seconds: float | None = Field(default=None, gt=0)
    # An idle loop polls at most this far apart even when no Kafka hint arrives.
    indexer_poll_seconds: float = Field(default=5.0, gt=0)
    indexer_idle_backoff_min_seconds: float = Field(default=0.05, gt=0)
    # After SIGTERM: how long running tasks may take before they are cancelled.
    indexer_grace_period_seconds: float = Field(default=30.0, ge=0)
    # Unique per process by default (host:pid:random), so a restart is a new owner.
    indexer_worker_id: str | None = None
    # Connections reserved for heartbeats, apart from the claim/result pool: a busy pool
    # must not starve a lease.
    indexer_heartbeat_pool_size: int = Field(default=2, ge=1, le=16)
    # Which DocumentVersionIndexer the CLI wires in: the parse -> chunk -> embed -> pgvector
    # pipeline (services/indexer/pipeline/version_indexer.py); the embedding provider is
    # configured by KB_EMBEDDING_* (services/embedding/settings.py).
    indexer: Literal["pipeline"] = "pipeline"
    # Tokens per chunk, headings included; capped by what the embedding model reads.
    indexer_chunk_max_tokens: int = Field(default=256, ge=16, le=8192)
    indexer_chunk_overlap_tokens: int = Field(default=0, ge=0)
    # maintenance_work_mem of an HNSW build over existing rows (a rebuild): the graph must fit
    # or the build crawls (a PostgreSQL size: 512MB, 1GB, ...).
    indexer_index_build_memory: str = Field(default="1GB", pattern=r"^[0-9]+ ?(kB|MB|GB|TB)$")
    # A tenant whose current versions hold at least this many chunks of the model gets an
    # HNSW graph of its own (services/indexer/sink/tenant_graphs.py); 0: none. Below
    # KB_SEARCH_EXACT_MAX_CHUNKS search ranks every readable chunk anyway.
    indexer_tenant_graph_min_chunks: int = Field(default=5_000, ge=0)
    # How often `kb indexer run` looks for tenants that have grown past it.
    indexer_tenant_graph_check_seconds: float = Field(default=300.0, gt=0)
    # Whether the indexers build each model's partitioned HNSW index (one graph per
    # partition of knowledge_chunk). Off: search walks only the tenants' own graphs and ranks
    # a tenant without one exactly, and no chunk write pays an insert into a graph no search
    # walks (docs/architecture.md, "The indexer", ANN indexes). An index already built is kept (and
    # maintained) until `kb index partition-graphs drop`.
    indexer_partition_graphs: bool = False
    # Wall time one document's parse + chunk may take (DOCUMENT_PARSE_TIMEOUT beyond it).
    indexer_parse_budget_seconds: float = Field(default=120.0, gt=0)
    # Processes parsing documents; by default one per slot, at most one per CPU.
    indexer_parse_workers: int | None = Field(default=None, ge=1, le=64)
    # Plain text and Markdown smaller than this are parsed in the indexer process itself,
    # not sent to a parse process (whose round trip costs more than their parse); 0: never.
    indexer_parse_inline_max_bytes: int = Field(default=65_536, ge=0, le=16 * 1024 * 1024)
    # Address space of each parse process (RLIMIT_AS, Linux); past it the document is
    # DOCUMENT_TOO_LARGE and the process is replaced. 0: no limit. At least 512 MiB: an idle
    # parse process already takes ~300 MB of address space, and below that every failed
    # parse would read as out of memory.
    indexer_parse_memory_limit_bytes: int = Field(default=1024 * 1024 * 1024, ge=0)

    @field_validator("indexer_parse_memory_limit_bytes")
    @classmethod
    def _room_to_parse(cls, value: int) -> int:
        if 0 < value < 512 * 1024 * 1024:
            raise ValueError("must be 0 (no limit) or at least 536870912 (512 MiB)")
        return value

    # The most one DOCX archive member may decompress to (DOCUMENT_TOO_LARGE beyond it).
    indexer_parse_max_member_bytes: int = Field(default=64 * 1024 * 1024, ge=1)
    # Kafka hints (kb.index-hints.<tier>, consumer group kb-indexer.<tier>) wake the claim
    # loop; off, the indexer works by its poll timer alone (`kb indexer run --no-hints`).
    indexer_hints: bool = True
    # Serve /metrics (Prometheus) on this port (`--metrics-port`); unset: no listener.
    indexer_metrics_port: int | None = Field(default=None, ge=1, le=65535)
    indexer_metrics_host: str = "127.0.0.1"
    # How often the process refreshes its queue gauges (one query for all slots).
    indexer_metrics_interval_seconds: float = Field(default=5.0, gt=0)

    @property
    def completion_max_wait_seconds(self) -> float:
        """``indexer_completion_max_wait_seconds``, or four leases when unset."""
        if self.indexer_completion_max_wait_seconds is not None:
            return self.indexer_completion_max_wait_seconds
        return 4 * self.indexer_lease_seconds

    @model_validator(mode="after")
    def _completion_wait_not_below_a_lease(self) -> IndexerSettings:
        wait = self.indexer_completion_max_wait_seconds
        if wait is not None and wait < self.indexer_lease_seconds:
            raise ValueError("indexer_completion_max_wait_seconds must be >= indexer_lease_seconds")
        return self

    @model_validator(mode="after")
    def _cap_not_below_base(self) -> IndexerSettings:
        if self.indexer_backoff_cap_seconds < self.indexer_backoff_base_seconds:
            raise ValueError("indexer_backoff_cap_seconds must be >= indexer_backoff_base_seconds")
        if self.indexer_chunk_overlap_tokens >= self.indexer_chunk_max_tokens // 2:
            raise ValueError(
                "indexer_chunk_overlap_tokens must be below half of indexer_chunk_max_tokens"
            )
        return self
