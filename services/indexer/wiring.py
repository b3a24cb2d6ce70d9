"""How `kb indexer` assembles a running indexer: pools, the pipeline (embedder, parse
processes, pgvector sink), the worker, the Kafka hint consumer, the metrics.

The CLI imports this only when a command runs, so `kb indexer --help` stays cheap.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

import asyncpg

from services.embedding.factory import build_embedder
from services.embedding.guard.factory import guarded
from services.embedding.guard.quota import Purpose
from services.embedding.settings import load_embedding_settings
from services.index.generation import IndexGeneration
from services.indexer.gc.collector import GarbageCollector
from services.indexer.gc.retention import RetentionCollector
from services.indexer.gc.settings import GcSettings, RetentionSettings
from services.indexer.generations.build import pipeline_builder
from services.indexer.metrics import HintMetrics, QueueGaugeSampler, WorkerMetrics
from services.indexer.pipeline.generations import (
    GenerationPipelines,
    batching_of,
    tenant_share_of,
)
from services.indexer.pipeline.parsing import ParseLimits
from services.indexer.pipeline.parsing.pool import ParsePool
from services.indexer.pipeline.source_pg import PgVersionSource
from services.indexer.pipeline.version_indexer import (
    PipelineIndexer,
    chunking_strategy,
    index_generation,
)
from services.indexer.pool import open_pool
from services.indexer.ports import ClaimGate, DocumentVersionIndexer
from services.indexer.queue.hints import HintConsumer
from services.indexer.queue.store_pg import PgTaskQueue
from services.indexer.queue.worker import RunOnceResult, Worker
from services.indexer.retry import RetryPolicy
from services.indexer.settings import IndexerSettings
from services.indexer.sink.generations import TaskGenerations
from services.indexer.sink.pgvector import PgVectorSink
from services.indexer.sink.tenant_graphs import PgTenantGraphs
from services.runtime.backoff import Backoff
from services.runtime.commands.cli_options import serve_metrics
from services.runtime.commands.cli_support import load_settings, run_async
from services.runtime.cpus import usable_cores
from services.runtime.heap import collect_young_less_often, freeze_start_up_heap
from services.runtime.identity import owner_id
from services.runtime.logging import get_logger
from services.runtime.pg.waiting import Step, StoppedWaiting, once, retrying
from services.runtime.settings import section_of
from services.runtime.signals import stop_on_signals, unless_stopped

log = get_logger(__name__)
T = TypeVar("T")

# Tests wrap the pipeline (a crash test's hanging indexer); production passes nothing.
WrapIndexer = Callable[[DocumentVersionIndexer], DocumentVersionIndexer]


@contextlib.asynccontextmanager
async def pipeline_indexer(
    settings: IndexerSettings,
    pool: asyncpg.Pool[Any],
    *,
    slots: int,
    owner: str,
    step: Step = once,
) -> AsyncIterator[PipelineIndexer]:
    """The pipeline with its embedder, parse processes and sink; the index generation and
    the default search generation are registered once here, before any task is claimed;
    every other search generation's pipeline is built when its first task arrives
    (pipeline/generations.py); everything is closed on the way out.

    A remote provider's requests go through its shared guard (services.embedding.guard):
    the fleet's limiter and circuit breaker; ``claim_gate`` is then that guard, which the
    worker asks before it claims.

    ``step`` runs each database step of the start (`kb indexer run`: again while the
    database is away, services/runtime/pg/waiting.py)."""
    embedding = load_embedding_settings()
    embedder = build_embedder(embedding)
    requests, guard = guarded(embedding, embedder, pool, purpose=Purpose.INDEX, owner=owner)
    try:
        # A local model loads (and its file is checked) while the first tasks are claimed
        # and parsed: their requests wait for it, and a bad install stops the process
        # (with_worker) before any task's attempt is spent on it.
        warm_up = getattr(embedder, "warm_up", None)
        warming: asyncio.Task[None] | None = (
            asyncio.create_task(warm_up()) if warm_up is not None else None
        )
        strategy = chunking_strategy(
            embedder,
            max_tokens=settings.indexer_chunk_max_tokens,
            overlap_tokens=settings.indexer_chunk_overlap_tokens,
        )
        workers = settings.indexer_parse_workers or max(1, min(slots, usable_cores()))
        parse_pool = ParsePool(
            workers=workers,
            limits=ParseLimits(
                budget_seconds=settings.indexer_parse_budget_seconds,
                memory_limit_bytes=settings.indexer_parse_memory_limit_bytes,
                max_member_bytes=settings.indexer_parse_max_member_bytes,
            ),
            inline_below_bytes=settings.indexer_parse_inline_max_bytes,
        )
        pipelines: GenerationPipelines | None = None
        try:
            sink = PgVectorSink(
                pool,
                index_build_memory=settings.indexer_index_build_memory,
                partition_graphs=settings.indexer_partition_graphs,
            )
            generation = index_generation(embedder, strategy)
            await step("ensure_generation", lambda: sink.ensure_generation(generation))
            default = await step(
                "register_default",
                lambda: sink.register_default(
                    generation,
                    chunk_max_tokens=settings.indexer_chunk_max_tokens,
                    chunk_overlap_tokens=settings.indexer_chunk_overlap_tokens,
                ),
            )
            indexer = PipelineIndexer(
                PgVersionSource(pool),
                parse_pool,
                requests,
                sink,
                strategy=strategy,
                batching=batching_of(embedding),
                embedder_ready=warming,
                tenant_share=tenant_share_of(guard, embedding),
                search=default,
            )
            indexer.claim_gate = guard
            # Tasks of other generations (a backfill, a publish's dual write) get theirs
            # built when the first of them arrives.
            pipelines = GenerationPipelines(
                indexer.default,
                TaskGenerations(pool),
                pipeline_builder(pool, sink, owner=owner),
            )
            indexer.use_generations(pipelines)
            yield indexer
        finally:
            if pipelines is not None:
                await pipelines.aclose()
            await parse_pool.aclose()
    finally:
        if warming is not None and not warming.done():
            warming.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await warming
        await embedder.aclose()


async def _unless_warm_up_fails(
    work: Coroutine[Any, Any, T], ready: asyncio.Future[None] | None
) -> T:
    """``work``'s result; but if the embedder's warm-up fails first, ``work`` is cancelled
    (claimed tasks are left to their leases) and the warm-up's error is raised: `kb indexer
    run` exits with it instead of failing every task it claimed."""
    if ready is None:
        return await work
    failed = asyncio.Event()
    ready.add_done_callback(
        lambda done: failed.set() if not done.cancelled() and done.exception() else None
    )
    finished = await unless_stopped(work, failed)
    if failed.is_set():
        error = ready.exception()
        assert error is not None
        log.error("embedder.warm_up_failed", error=str(error))
        raise error
    return finished.result()


def build_worker(
    settings: IndexerSettings,
    pool: asyncpg.Pool[Any],
    indexer: DocumentVersionIndexer,
    tier: str,
    concurrency: int,
    *,
    heartbeat_pool: asyncpg.Pool[Any] | None = None,
    observer: WorkerMetrics | None = None,
    gate: ClaimGate | None = None,
    owner: str | None = None,
) -> Worker:
    return Worker(
        PgTaskQueue(
            pool,
            heartbeat_pool=heartbeat_pool,
            committing_groups=settings.indexer_committing_groups,
            completion_max_wait_seconds=settings.completion_max_wait_seconds,
        ),
        indexer,
        tier=tier,
        owner=owner or settings.indexer_worker_id,
        lease_seconds=settings.indexer_lease_seconds,
        policy=section_of(
            RetryPolicy, settings, "indexer_", jitter=settings.indexer_backoff_jitter
        ),
        concurrency=concurrency,
        poll_interval_seconds=settings.indexer_poll_seconds,
        idle_backoff_min_seconds=settings.indexer_idle_backoff_min_seconds,
        grace_period_seconds=settings.indexer_grace_period_seconds,
        observer=observer,
        gate=gate,
        completion_max_wait_seconds=settings.completion_max_wait_seconds,
    )


def main_pool_size(concurrency: int) -> int:
    """Connections for claims, results and the sink: one per slot up to 16, then no more.
    The slots' reads share queries (services/runtime/pg/coalesce.py) and their results commit
    in groups on a connection or two, so beyond 16 slots more connections would stay idle; a
    slot's own statements (a failure, a large document's slices) wait for one instead.
    Plus one for claims and one spare."""
    return min(concurrency, 16) + 2


def with_worker(
    settings: IndexerSettings,
    tier: str,
    concurrency: int,
    work: Callable[[Worker, asyncpg.Pool[Any], IndexGeneration], Coroutine[Any, Any, T]],
    *,
    wrap: WrapIndexer | None = None,
    observer: WorkerMetrics | None = None,
    stop: asyncio.Event | None = None,
) -> T:
    """A worker over the real pipeline on its own pools: one for claims, results and the
    sink, a small one reserved for heartbeats.

    Given ``stop``, SIGTERM/SIGINT set it from the start on, and the start's database steps
    (the pools, the generation's registration) wait for a database that is away until it
    answers or ``stop`` is set (``StoppedWaiting``); without it they fail at once."""
    step: Step = once
    if stop is not None:
        poll = settings.indexer_poll_seconds
        # The claim loop's pauses: from a fraction of a second up to the poll interval.
        step = retrying(stop, Backoff(min(0.5, poll), poll, 0.5))

    async def _start_and_work() -> T:
        async with contextlib.AsyncExitStack() as stack:
            size = main_pool_size(concurrency)
            pool = await step("open_pool", lambda: open_pool(settings, size))
            stack.push_async_callback(pool.close)
            beats = await step(
                "open_heartbeat_pool",
                lambda: open_pool(settings, settings.indexer_heartbeat_pool_size),
            )
            stack.push_async_callback(beats.close)
            owner = settings.indexer_worker_id or owner_id()
            pipeline = await stack.enter_async_context(
                pipeline_indexer(settings, pool, slots=concurrency, owner=owner, step=step)
            )
            indexer: DocumentVersionIndexer = pipeline
            if wrap is not None:
                indexer = wrap(indexer)
            worker = build_worker(
                settings,
                pool,
                indexer,
                tier,
                concurrency,
                heartbeat_pool=beats,
                observer=observer,
                gate=pipeline.claim_gate,
                owner=owner,
            )
            return await _unless_warm_up_fails(
                work(worker, pool, pipeline.generation), pipeline.embedder_ready
            )

    async def _run() -> T:
        if stop is None:
            return await _start_and_work()
        with stop_on_signals(stop):
            return await _start_and_work()

    return run_async(_run())


def run_workers(
    settings: IndexerSettings,
    tier: str,
    slots: int,
    *,
    hints: bool | None = None,
    metrics_port: int | None = None,
    wrap: WrapIndexer | None = None,
) -> None:
    """``kb indexer run``: the worker loop, the hint consumer and the gauges, until
    SIGTERM/SIGINT. A database away at start is waited for (``database.unavailable``), as
    the loops wait for it once running: a supervisor need not restart the process."""
    use_hints = settings.indexer_hints if hints is None else hints
    warn_without_graphs(settings)
    # Read before anything starts: a bad KB_INDEX_* stops the process with its name.
    collecting = load_settings(GcSettings)
    retaining = load_settings(RetentionSettings)
    port = metrics_port if metrics_port is not None else settings.indexer_metrics_port
    if serve_metrics(port, settings.indexer_metrics_host):
        log.info("metrics.serving", host=settings.indexer_metrics_host, port=port)
    observer = WorkerMetrics(tier)
    stop = asyncio.Event()

    async def _work(worker: Worker, pool: asyncpg.Pool[Any], generation: IndexGeneration) -> None:
        sampler = QueueGaugeSampler(
            pool,
            [tier],
            lease_seconds=settings.indexer_lease_seconds,
            interval_seconds=settings.indexer_metrics_interval_seconds,
            observer=observer,
        )
        hint_metrics = HintMetrics(tier)

        tenant_graphs = PgTenantGraphs(
            pool,
            min_chunks=settings.indexer_tenant_graph_min_chunks,
            index_build_memory=settings.indexer_index_build_memory,
        )

        collector = GarbageCollector(pool, collecting)
        retention = RetentionCollector(pool, retaining)

        async def main(stop: asyncio.Event) -> None:
            jobs = [
                worker.run(stop),
                sampler.run(stop),
                collector.run(stop, interval_seconds=collecting.gc_interval_seconds),
                retention.run(stop),
                # Every model served, not only this indexer's: a tenant switched to
                # another model (`kb index generations switch`) may stay on it.
                tenant_graphs.run(
                    stop, interval_seconds=settings.indexer_tenant_graph_check_seconds
                ),
            ]
            if use_hints:
                # aiokafka is imported only by an indexer that listens for hints.
                from services.indexer.queue.hints_kafka import KafkaHintSource

                consumer = HintConsumer(
                    tier=tier,
                    wake=worker.wake,
                    connect=lambda: KafkaHintSource.connect(settings, tier),
                    on_change=hint_metrics,
                    contexts=worker.hint_contexts,
                )
                jobs.append(consumer.run(stop))
            else:
                log.info("hints.off", tier=tier, poll_seconds=settings.indexer_poll_seconds)
            await asyncio.gather(*jobs)

        # Everything start-up made (modules, pools, the pipeline) lives as long as the
        # process: out of the collector's full passes, which walked it all to free nothing.
        log.info(
            "heap.frozen",
            objects=freeze_start_up_heap(),
            young_collection_threshold=collect_young_less_often(),
        )
        await main(stop)

    try:
        with_worker(settings, tier, slots, _work, wrap=wrap, observer=observer, stop=stop)
    except StoppedWaiting as stopped:
        log.info("indexer.stopped_at_start", step=str(stopped))


def warn_without_graphs(settings: IndexerSettings) -> bool:
    """Logs ``ann_index.none`` when neither graph is built: every search then ranks its
    readable chunks exactly, however many. Allowed (tenants that all stay small need no
    graph), but rarely what a large one wants. True when it warned."""
    if settings.indexer_partition_graphs or settings.indexer_tenant_graph_min_chunks > 0:
        return False
    log.warning(
        "ann_index.none",
        reason="no HNSW graph is built: every search ranks its readable chunks exactly",
        partition_graphs="KB_INDEXER_PARTITION_GRAPHS",
        tenant_graphs="KB_INDEXER_TENANT_GRAPH_MIN_CHUNKS",
    )
    return True


def run_once(settings: IndexerSettings, tier: str) -> RunOnceResult:
    async def _work(
        worker: Worker, pool: asyncpg.Pool[Any], generation: IndexGeneration
    ) -> RunOnceResult:
        return await worker.run_once()

    return with_worker(settings, tier, 1, _work)
