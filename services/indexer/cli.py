"""`kb indexer run|run-once` and `kb tasks list|show|requeue`.

stdout carries the answer (a result word, task lines, JSON); logs go to stderr.
"""

from __future__ import annotations

import contextlib
import dataclasses
import getpass
import json
import re
import uuid
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any, TypeVar

import asyncpg
import typer

from services.indexer.ports import DocumentVersionIndexer
from services.indexer.queue_pg import PgTaskQueue, skip_session_reset
from services.indexer.settings import IndexerSettings
from services.indexer.task import InvalidTransition, RetryPolicy, TaskStatus
from services.indexer.version_check import TestOnlyHangingIndexer, VersionCheckIndexer
from services.indexer.worker import RunOnceResult, Worker
from services.runtime import cli_support
from services.runtime.cli_support import run_async
from services.runtime.db import create_pool
from services.runtime.errors import BadInput, NotFound
from services.runtime.logging import configure_logging
from services.runtime.signals import run_until_signalled

indexer_app = typer.Typer(
    help="Index workers: claim due tasks of one tier and index them.", no_args_is_help=True
)
tasks_app = typer.Typer(help="Inspect index tasks and requeue DEAD ones.", no_args_is_help=True)

T = TypeVar("T")
_TIER = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}$")


def load_settings(**overrides: Any) -> IndexerSettings:
    """The environment's settings; a bad one is a ConfigError that never shows its value."""
    return cli_support.load_settings(IndexerSettings, **overrides)


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


def build_indexer(settings: IndexerSettings, pool: asyncpg.Pool[Any]) -> DocumentVersionIndexer:
    checker = VersionCheckIndexer(pool)
    if settings.indexer == "test-only-hang":
        return TestOnlyHangingIndexer(checker, settings.test_only_hang_generations)
    return checker


def build_worker(
    settings: IndexerSettings,
    pool: asyncpg.Pool[Any],
    tier: str,
    concurrency: int,
    *,
    heartbeat_pool: asyncpg.Pool[Any] | None = None,
) -> Worker:
    return Worker(
        PgTaskQueue(pool, heartbeat_pool=heartbeat_pool),
        build_indexer(settings, pool),
        tier=tier,
        owner=settings.indexer_worker_id,
        lease_seconds=settings.indexer_lease_seconds,
        policy=RetryPolicy(
            backoff_base_seconds=settings.indexer_backoff_base_seconds,
            backoff_cap_seconds=settings.indexer_backoff_cap_seconds,
            jitter=settings.indexer_backoff_jitter,
            max_retry_after_seconds=settings.indexer_max_retry_after_seconds,
        ),
        concurrency=concurrency,
        poll_interval_seconds=settings.indexer_poll_seconds,
        idle_backoff_min_seconds=settings.indexer_idle_backoff_min_seconds,
        grace_period_seconds=settings.indexer_grace_period_seconds,
    )


async def _open_pool(settings: IndexerSettings, size: int) -> asyncpg.Pool[Any]:
    return await create_pool(settings, min_size=1, max_size=size, reset=skip_session_reset)


def _with_pool(
    settings: IndexerSettings, size: int, work: Callable[[asyncpg.Pool[Any]], Awaitable[T]]
) -> T:
    async def _run() -> T:
        pool = await _open_pool(settings, size)
        try:
            return await work(pool)
        finally:
            await pool.close()

    return run_async(_run())


def _with_worker(
    settings: IndexerSettings,
    tier: str,
    concurrency: int,
    work: Callable[[Worker], Awaitable[T]],
) -> T:
    """A worker on its own pools: one for claims and results (one connection per slot and
    one for claims, plus one spare), a small one reserved for heartbeats."""

    async def _run() -> T:
        async with contextlib.AsyncExitStack() as pools:
            pool = await _open_pool(settings, concurrency + 2)
            pools.push_async_callback(pool.close)
            beats = await _open_pool(settings, settings.indexer_heartbeat_pool_size)
            pools.push_async_callback(beats.close)
            worker = build_worker(settings, pool, tier, concurrency, heartbeat_pool=beats)
            return await work(worker)

    return run_async(_run())


@indexer_app.command("run")
def run(
    tier: str = typer.Option(..., "--tier", help="The tenant tier whose tasks to claim."),
    concurrency: int | None = typer.Option(
        None,
        "--concurrency",
        min=1,
        max=256,
        help="Tasks at once (default KB_INDEXER_CONCURRENCY).",
    ),
) -> None:
    """Claim and index tasks until SIGTERM; then finish running ones within the grace period."""
    settings = load_settings()
    tier = _tier(tier)
    slots = concurrency or settings.indexer_concurrency
    configure_logging(settings.log_level, settings.log_format, service="indexer")

    async def _work(worker: Worker) -> None:
        await run_until_signalled(worker.run)

    _with_worker(settings, tier, slots, _work)


@indexer_app.command("run-once")
def run_once(
    tier: str = typer.Option(..., "--tier", help="The tenant tier whose task to claim."),
) -> None:
    """Claim at most one task, see it through, print IDLE, SUCCEEDED, FAILED or LOST_LEASE.

    Exactly one of those words, always: an error the worker cannot classify (the database
    unreachable, the outcome of a write unknown) prints FAILED, and the error on stderr."""
    try:
        settings = load_settings()
        tier = _tier(tier)
        configure_logging(settings.log_level, settings.log_format, service="indexer")

        async def _work(worker: Worker) -> RunOnceResult:
            return await worker.run_once()

        result = _with_worker(settings, tier, 1, _work)
    except Exception as error:
        typer.echo(RunOnceResult.FAILED)
        cli_support.fail(error)
    typer.echo(result)


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
        help="Grant a full attempt budget (KB_INDEXER_MAX_ATTEMPTS) instead of one more attempt.",
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
                wanted, by=who, reset_attempts=reset_attempts, budget=settings.indexer_max_attempts
            )
        except InvalidTransition as error:
            # Asking to requeue a task that is not DEAD is the operator's mistake: exit 2.
            raise BadInput(error.message, code=error.code) from error
        return _as_json(record)

    typer.echo(json.dumps(_with_pool(settings, 1, _work), indent=2, sort_keys=True))
