"""`kb indexer run|run-once` and `kb tasks list|show|requeue`.

stdout carries the answer (a result word, task lines, JSON); logs go to stderr.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import getpass
import json
import os
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime
from typing import Any, TypeVar

import asyncpg
import typer
from pydantic import ValidationError

from services.indexer.embedding.factory import build_embedder
from services.indexer.embedding.settings import load_embedding_settings
from services.indexer.parsing import ParseLimits
from services.indexer.parsing.pool import ParsePool
from services.indexer.pipeline import PipelineIndexer, chunking_strategy
from services.indexer.ports import DocumentVersionIndexer
from services.indexer.queue_pg import PgTaskQueue, skip_session_reset
from services.indexer.settings import IndexerSettings
from services.indexer.sink_pgvector import PgVectorSink
from services.indexer.source_pg import PgVersionSource
from services.indexer.task import InvalidTransition, RetryPolicy, TaskStatus
from services.indexer.worker import Worker, run_until_signalled
from services.runtime.cli_support import run_async
from services.runtime.db import create_pool
from services.runtime.errors import BadInput, ConfigError, NotFound
from services.runtime.logging import configure_logging

indexer_app = typer.Typer(
    help="Index workers: claim due tasks of one tier and index them.", no_args_is_help=True
)
tasks_app = typer.Typer(help="Inspect index tasks and requeue DEAD ones.", no_args_is_help=True)

T = TypeVar("T")
_TIER = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}$")


def load_settings(**overrides: Any) -> IndexerSettings:
    try:
        base = IndexerSettings()
        return base.model_copy(update=overrides) if overrides else base
    except ValidationError as error:
        raise ConfigError(f"invalid indexer settings: {error}") from error


def _tier(value: str) -> str:
    if not _TIER.match(value):
        raise BadInput(f"tier {value!r}: lowercase letters, digits, '-' and '_', at most 32")
    return value


def _task_id(value: str) -> uuid.UUID:
    try:
        return uuid.UUID(value)
    except ValueError:
        raise BadInput(f"{value!r} is not a task id (a UUID)") from None


def _status(value: str | None) -> TaskStatus | None:
    if value is None:
        return None
    try:
        return TaskStatus(value.upper())
    except ValueError:
        known = ", ".join(s.value for s in TaskStatus)
        raise BadInput(f"unknown status {value!r}; one of {known}") from None


def _os_user() -> str:
    try:
        return getpass.getuser()
    except (OSError, KeyError):  # no USER and no passwd entry (some containers)
        raise BadInput("cannot tell who you are: say it with --by") from None


@contextlib.asynccontextmanager
async def pipeline_indexer(
    settings: IndexerSettings, pool: asyncpg.Pool[Any], *, slots: int
) -> AsyncIterator[PipelineIndexer]:
    """The pipeline with its embedder, parse processes and sink; the index generation is
    registered once here, before any task is claimed; everything is closed on the way out."""
    embedding = load_embedding_settings()
    embedder = build_embedder(embedding)
    try:
        # A local model is loaded (and its file checked) now: a bad install fails at start,
        # not inside the first task.
        warm_up = getattr(embedder, "warm_up", None)
        if warm_up is not None:
            await warm_up()
        strategy = chunking_strategy(
            embedder,
            max_tokens=settings.chunk_max_tokens,
            overlap_tokens=settings.chunk_overlap_tokens,
        )
        workers = settings.parse_workers or max(1, min(slots, os.cpu_count() or 1))
        parse_pool = ParsePool(
            workers=workers, limits=ParseLimits(budget_seconds=settings.parse_budget_seconds)
        )
        try:
            sink = PgVectorSink(pool)
            indexer = PipelineIndexer(
                PgVersionSource(pool),
                parse_pool,
                embedder,
                sink,
                strategy=strategy,
                batch_size=embedding.batch_size,
                max_batch_tokens=embedding.max_batch_tokens,
            )
            await sink.ensure_generation(indexer.generation)
            yield indexer
        finally:
            await parse_pool.aclose()
    finally:
        await embedder.aclose()


def build_worker(
    settings: IndexerSettings,
    pool: asyncpg.Pool[Any],
    indexer: DocumentVersionIndexer,
    tier: str,
    concurrency: int,
) -> Worker:
    return Worker(
        PgTaskQueue(pool),
        indexer,
        tier=tier,
        owner=settings.worker_id,
        lease_seconds=settings.lease_seconds,
        policy=RetryPolicy(
            backoff_base_seconds=settings.backoff_base_seconds,
            backoff_cap_seconds=settings.backoff_cap_seconds,
            jitter=settings.backoff_jitter,
        ),
        concurrency=concurrency,
        poll_interval_seconds=settings.poll_interval_seconds,
        idle_backoff_min_seconds=settings.idle_backoff_min_seconds,
        grace_period_seconds=settings.grace_period_seconds,
    )


def _with_pool(
    settings: IndexerSettings, size: int, work: Callable[[asyncpg.Pool[Any]], Awaitable[T]]
) -> T:
    async def _run() -> T:
        pool = await create_pool(settings, min_size=1, max_size=size, reset=skip_session_reset)
        try:
            return await work(pool)
        finally:
            await pool.close()

    return run_async(_run())


# Tests wrap the pipeline (a crash test's hanging indexer); production passes nothing.
WrapIndexer = Callable[[DocumentVersionIndexer], DocumentVersionIndexer]


def run_workers(
    settings: IndexerSettings, tier: str, slots: int, *, wrap: WrapIndexer | None = None
) -> None:
    """``kb indexer run``: the worker loop until SIGTERM/SIGINT."""

    async def _work(pool: asyncpg.Pool[Any]) -> None:
        async with pipeline_indexer(settings, pool, slots=slots) as indexer:
            wrapped = wrap(indexer) if wrap is not None else indexer
            worker = build_worker(settings, pool, wrapped, tier, slots)
            await run_until_signalled(worker, asyncio.Event())

    # One connection per slot for heartbeats and results, one for claims.
    _with_pool(settings, slots + 2, _work)


@indexer_app.command("run")
def run(
    tier: str = typer.Option(..., "--tier", help="The tenant tier whose tasks to claim."),
    concurrency: int | None = typer.Option(
        None, "--concurrency", min=1, max=256, help="Tasks at once (default KB_CONCURRENCY)."
    ),
) -> None:
    """Claim and index tasks until SIGTERM; then finish running ones within the grace period."""
    settings = load_settings()
    tier = _tier(tier)
    configure_logging(settings.log_level, settings.log_format, service="indexer")
    run_workers(settings, tier, concurrency or settings.concurrency)


@indexer_app.command("run-once")
def run_once(
    tier: str = typer.Option(..., "--tier", help="The tenant tier whose task to claim."),
) -> None:
    """Claim at most one task, see it through, print IDLE, SUCCEEDED, FAILED or LOST_LEASE."""
    settings = load_settings()
    tier = _tier(tier)
    configure_logging(settings.log_level, settings.log_format, service="indexer")

    async def _work(pool: asyncpg.Pool[Any]) -> str:
        async with pipeline_indexer(settings, pool, slots=1) as indexer:
            return str(await build_worker(settings, pool, indexer, tier, 1).run_once())

    typer.echo(_with_pool(settings, 3, _work))


def _jsonable(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, uuid.UUID | TaskStatus):
        return str(value)
    return value


def _as_json(item: Any) -> dict[str, Any]:
    return {k: _jsonable(v) for k, v in dataclasses.asdict(item).items()}


@tasks_app.command("list")
def list_tasks(
    status: str | None = typer.Option(None, "--status", help="PENDING, RUNNING, RETRY_WAIT, ..."),
    tenant: str | None = typer.Option(None, "--tenant", help="Only this tenant's tasks."),
    tier: str | None = typer.Option(None, "--tier", help="Only this tier's tasks."),
    limit: int = typer.Option(100, "--limit", min=1, max=10_000),
) -> None:
    """One line per task, most recently changed first."""
    settings = load_settings()
    wanted = _status(status)

    async def _work(pool: asyncpg.Pool[Any]) -> None:
        tasks = await PgTaskQueue(pool).list_tasks(
            status=wanted, tenant_id=tenant, tier=tier, limit=limit
        )
        for task in tasks:
            typer.echo(
                f"{task.task_id}  {task.status:<10}  {task.tenant_id}  {task.tier}  "
                f"v{task.version_number}  attempts={task.attempts}/{task.max_attempts}  "
                f"{task.error_code or '-'}  {task.updated_at.isoformat()}"
            )

    _with_pool(settings, 1, _work)


@tasks_app.command("show")
def show(task_id: str = typer.Argument(..., help="The task id (UUID).")) -> None:
    """The task's fields and its requeue history, as JSON."""
    settings = load_settings()
    wanted = _task_id(task_id)

    async def _work(pool: asyncpg.Pool[Any]) -> dict[str, Any]:
        queue = PgTaskQueue(pool)
        task = await queue.get(wanted)
        if task is None:
            raise NotFound(f"no index task {wanted}", code="TASK_NOT_FOUND")
        shown = _as_json(task)
        shown["requeues"] = [_as_json(r) for r in await queue.requeue_history(wanted)]
        return shown

    typer.echo(json.dumps(_with_pool(settings, 1, _work), indent=2, sort_keys=True))


@tasks_app.command("requeue")
def requeue(
    task_id: str = typer.Argument(..., help="The DEAD task's id (UUID)."),
    reset_attempts: bool = typer.Option(
        False,
        "--reset-attempts",
        help="Grant a full attempt budget (KB_MAX_ATTEMPTS) instead of one more attempt.",
    ),
    by: str | None = typer.Option(None, "--by", help="Who requeues (default: the OS user)."),
) -> None:
    """Put a DEAD task back to PENDING; the requeue is recorded (who, when, budget)."""
    settings = load_settings()
    wanted = _task_id(task_id)
    who = (by or _os_user()).strip()
    if not who or len(who) > 200:
        raise BadInput("--by must be 1 to 200 characters")

    async def _work(pool: asyncpg.Pool[Any]) -> dict[str, Any]:
        try:
            record = await PgTaskQueue(pool).requeue(
                wanted, by=who, reset_attempts=reset_attempts, budget=settings.max_attempts
            )
        except InvalidTransition as error:
            # Asking to requeue a task that is not DEAD is the operator's mistake: exit 2.
            raise BadInput(error.message, code=error.code) from error
        return _as_json(record)

    typer.echo(json.dumps(_with_pool(settings, 1, _work), indent=2, sort_keys=True))
