"""`kb indexer run|run-once` and `kb tasks list|show|requeue`.

stdout carries the answer (a result word, task lines, JSON); logs go to stderr. Drivers, the
pipeline and the worker are imported when a command runs (services/indexer/wiring.py), so
`--help` stays cheap.
"""

from __future__ import annotations

import dataclasses
import getpass
import json
import re
import uuid
from datetime import datetime
from typing import TYPE_CHECKING, Any

import typer

from services.indexer.pool import load_settings, with_pool
from services.runtime.commands import cli_support
from services.runtime.commands.cli_options import metrics_port_option
from services.runtime.errors import BadInput, NotFound
from services.runtime.indexing.tasks import TaskStatus

if TYPE_CHECKING:
    import asyncpg

indexer_app = typer.Typer(
    help="Index workers: claim due tasks of one tier and index them.", no_args_is_help=True
)
tasks_app = typer.Typer(help="Inspect index tasks and requeue DEAD ones.", no_args_is_help=True)

_TIER = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}$")


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
    no_hints: bool = typer.Option(
        False,
        "--no-hints",
        help="Read no Kafka hints: find work by the poll timer alone (KB_INDEXER_POLL_SECONDS).",
    ),
    metrics_port: int | None = metrics_port_option(
        "Serve Prometheus /metrics on 127.0.0.1:PORT (default KB_INDEXER_METRICS_PORT)."
    ),
) -> None:
    """Claim and index tasks until SIGTERM; then finish running ones within the grace period."""
    from services.runtime.logging import configure_logging
    from services.runtime.tracing.setup import configure_tracing

    settings = load_settings()
    tier = _tier(tier)
    slots = concurrency or settings.indexer_concurrency
    configure_logging(settings.log_level, settings.log_format, service="indexer")
    configure_tracing("kb-indexer")
    from services.indexer.wiring import run_workers

    run_workers(settings, tier, slots, hints=False if no_hints else None, metrics_port=metrics_port)


@indexer_app.command("run-once")
def run_once(
    tier: str = typer.Option(..., "--tier", help="The tenant tier whose task to claim."),
) -> None:
    """Claim at most one task, see it through, print IDLE, SUCCEEDED, FAILED or LOST_LEASE.

    Exactly one of those words, always: an error the worker cannot classify (the database
    unreachable, the outcome of a write unknown) prints FAILED, and the error on stderr."""
    try:
        from services.indexer import wiring
        from services.runtime.logging import configure_logging

        settings = load_settings()
        tier = _tier(tier)
        configure_logging(settings.log_level, settings.log_format, service="indexer")
        result = str(wiring.run_once(settings, tier))
    except Exception as error:
        typer.echo("FAILED")
        cli_support.fail(error)
    typer.echo(result)


def _queue(pool: asyncpg.Pool[Any]) -> Any:
    from services.indexer.queue.store_pg import PgTaskQueue

    return PgTaskQueue(pool)


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
        tasks = await _queue(pool).list_tasks(
            status=wanted, tenant_id=tenant, tier=tier, limit=limit
        )
        from services.embedding.guard.store_pg import PgProviderStateStore

        # The embedding providers' shared state first, on stderr: the lines on stdout stay
        # one per task for scripts, and an operator sees at once why tasks wait.
        for view in await PgProviderStateStore(pool).views():
            typer.echo(f"# embedding provider {view.provider}: {view.summary()}", err=True)
        for task in tasks:
            typer.echo(
                f"{task.task_id}  {task.status:<10}  {task.tenant_id}  {task.tier}  "
                f"v{task.version_number}  attempts={task.attempts}/{task.max_attempts}  "
                f"{task.error_code or '-'}  {task.updated_at.isoformat()}"
            )

    with_pool(settings, 1, _work)


@tasks_app.command("show")
def show(task_id: str = typer.Argument(..., help="The task id (UUID).")) -> None:
    """The task's fields and its requeue history, as JSON."""
    settings = load_settings()
    wanted = _task_id(task_id)

    async def _work(pool: asyncpg.Pool[Any]) -> dict[str, Any]:
        queue = _queue(pool)
        task = await queue.get(wanted)
        if task is None:
            raise NotFound(f"no index task {wanted}", code="TASK_NOT_FOUND")
        shown = _as_json(task)
        shown["requeues"] = [_as_json(r) for r in await queue.requeue_history(wanted)]
        return shown

    typer.echo(json.dumps(with_pool(settings, 1, _work), indent=2, sort_keys=True))


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

    from services.indexer.task import InvalidTransition

    async def _work(pool: asyncpg.Pool[Any]) -> dict[str, Any]:
        try:
            record = await _queue(pool).requeue(
                wanted, by=who, reset_attempts=reset_attempts, budget=settings.indexer_max_attempts
            )
        except InvalidTransition as error:
            # Asking to requeue a task that is not DEAD is the operator's mistake: exit 2.
            raise BadInput(error.message, code=error.code) from error
        return _as_json(record)

    typer.echo(json.dumps(with_pool(settings, 1, _work), indent=2, sort_keys=True))
