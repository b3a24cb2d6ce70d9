"""`kb index check [--tenant T] [--repair]`, `kb index tenant-graphs [--min-chunks N]`,
`kb index partition-graphs drop [--model M]`.

check -- stdout: one line per drift, naming the document and the kind, with counts and ids
only, never content (and, with --repair, whether the check run after its task finished, or
after the removal of a deleted document's leftovers, still finds it); stderr: the summary.
Exit 0 when nothing drifted (or every drift was repaired and no other appeared), 1 when a
drift is left or its repair could not be verified, 2 on bad input.

generations -- `kb index generations ...` (services/indexer/generations/cli.py).

gc -- stderr: the chunks collected. Exit 0.

retention -- stderr: the superseded versions whose content was removed. Exit 0.

tenant-graphs -- stdout: one line per graph built; stderr: the summary. Exit 0 when every
large tenant of every model served has its graph, 1 when another process was building them
(run it again later) or a tenant's build failed (logged: tenant_graph.build_failed).

partition-graphs drop -- stdout: one line per partitioned index dropped, and per part of one
left unattached (an interrupted build's); stderr: a line per model and the summary. Exit 0
when no model named has a partition graph left, 1 when one is kept (a tenant at or over
KB_INDEXER_TENANT_GRAPH_MIN_CHUNKS has no valid graph of its own: run `kb index
tenant-graphs`, then this again), another process was building the model's graphs (its
generation or tenant-graphs lock held), or knowledge_chunk stayed locked through every try
(run it again), 2 when KB_INDEXER_PARTITION_GRAPHS is true (the indexers would build it
again), when KB_INDEXER_TENANT_GRAPH_MIN_CHUNKS is 0 (no tenant would have a graph) or on a
bad --model; nothing is dropped then.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import typer

from services.indexer.generations.cli import generations_app
from services.runtime.commands import cli_support
from services.runtime.errors import BadInput, ConfigError

if TYPE_CHECKING:
    import uuid

    import asyncpg

    from services.indexer.maintenance.index_check import Drift
    from services.indexer.maintenance.index_check_pg import PgIndexCheck, RepairOutcome
    from services.runtime.indexing.tasks import TaskStatus

index_app = typer.Typer(
    help="Check the search index against what was published, and repair it.",
    no_args_is_help=True,
)

index_app.add_typer(generations_app, name="generations")

partition_graphs_app = typer.Typer(
    help="The models' partitioned HNSW indexes (one graph per partition of knowledge_chunk).",
    no_args_is_help=True,
)
index_app.add_typer(partition_graphs_app, name="partition-graphs")

_TENANT = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
REPAIRED_BY = "kb index check --repair"


def _tenant(value: str | None) -> str | None:
    if value is not None and not _TENANT.match(value):
        raise BadInput(f"tenant {value!r}: lowercase letters, digits and '-', at most 63")
    return value


@index_app.callback()
def _group() -> None:
    """Check the search index against what was published, and repair it."""


@index_app.command("check")
def check(
    tenant: str | None = typer.Option(None, "--tenant", help="Only this tenant's documents."),
    repair: bool = typer.Option(
        False,
        "--repair",
        help="Create missing tasks and re-run SUCCEEDED tasks of drifted versions, wait for "
        "them to finish; remove what deleted documents still hold and finish erases left "
        "half-done; and check again.",
    ),
    timeout: float = typer.Option(
        300.0,
        "--timeout",
        min=0,
        help="With --repair: how long to wait for the repair tasks to finish, in seconds "
        "(0: queue them and do not wait; nothing is then verified).",
    ),
) -> None:
    """Find documents whose served version drifted from the published one: published but
    never queued, SUCCEEDED but not served, served with chunks missing, a pointer ahead of
    the published version, or chunked by older code than the indexers run; a deleted
    document's chunks, staged slices, served ACL or a pointer that is not its tombstone; an
    erased document's anything the erase removes. Exit 1 on drift (each document named on
    stdout). --repair counts a drift repaired only when the check run after its task
    finished (or after the removal, in batches of KB_INDEX_GC_BATCH_ROWS) no longer finds
    it."""
    from services.indexer.gc.settings import GcSettings
    from services.indexer.pool import load_settings

    settings = load_settings()
    batch_rows = cli_support.load_settings(GcSettings).gc_batch_rows
    wanted = _tenant(tenant)

    async def _work(pool: asyncpg.Pool[Any]) -> bool:
        from services.indexer.maintenance.index_check_pg import PgIndexCheck

        checker = PgIndexCheck(pool, batch_rows=batch_rows)
        checked, drifts = await checker.drift(wanted)
        if not repair:
            for drift in drifts:
                typer.echo(_line(drift))
            typer.echo(
                f"index check: {checked} documents, {len(drifts)} drifted, 0 repaired", err=True
            )
            return not drifts
        outcomes = [
            await checker.repair(drift, by=REPAIRED_BY, budget=settings.indexer_max_attempts)
            for drift in drifts
        ]
        return await _verify(checker, wanted, checked, outcomes, timeout)

    from services.indexer.pool import with_pool

    if not with_pool(settings, 1, _work):
        raise typer.Exit(cli_support.EXIT_FAILURE)


async def _verify(
    checker: PgIndexCheck,
    tenant: str | None,
    checked: int,
    outcomes: list[RepairOutcome],
    wait_seconds: float,
) -> bool:
    """Wait for the repairs' tasks, check again, and say of each drift whether it is gone;
    True when every one is and no other appeared. Removals were done by the repair itself:
    the check after them needs no wait."""
    from services.indexer.maintenance.index_check import (
        IN_PLACE,
        Verdict,
        appeared,
        drift_key,
        verify,
    )

    tasks = {o.task_id for o in outcomes if o.queued and o.task_id is not None}
    removed = any(o.queued and o.drift.repair.action in IN_PLACE for o in outcomes)
    statuses: dict[uuid.UUID, TaskStatus | None] = {}
    after: list[Drift] | None = None
    if wait_seconds > 0 and tasks:
        typer.echo(f"index check: waiting up to {wait_seconds:g}s for {len(tasks)} tasks", err=True)
        statuses = await checker.wait_for_tasks(tasks, timeout_seconds=wait_seconds)
    if (wait_seconds > 0 and tasks) or removed:
        after = (await checker.drift(tenant))[1]
    elif wait_seconds > 0:
        after = []
    after_keys = None if after is None else {drift_key(d) for d in after}
    repaired = 0
    for outcome in outcomes:
        waited = wait_seconds > 0 or outcome.drift.repair.action in IN_PLACE
        verified = verify(
            outcome.drift,
            queued=outcome.queued,
            note=outcome.note,
            task_status=None if outcome.task_id is None else statuses.get(outcome.task_id),
            after=after_keys if waited else None,
        )
        repaired += verified.verdict is Verdict.REPAIRED
        task = "-" if outcome.task_id is None else str(outcome.task_id)
        typer.echo(f"{_line(outcome.drift)}  ->  {verified.verdict} task={task} ({verified.note})")
    new = appeared([o.drift for o in outcomes], after or [])
    for drift in new:
        typer.echo(f"{_line(drift)}  ->  NEW (found by the check after the repair)")
    left = len(outcomes) - repaired + len(new)
    typer.echo(
        f"index check: {checked} documents, {len(outcomes)} drifted, {repaired} repaired, "
        f"{left} left",
        err=True,
    )
    return left == 0


@index_app.command("gc")
def gc(
    max_documents: int = typer.Option(
        1000, "--round", min=1, help="Documents per round; rounds go on until none is left."
    ),
) -> None:
    """Collect superseded chunks now (`kb indexer run` does it all the time): every document
    marked by a completion, in batches of KB_INDEX_GC_BATCH_ROWS, keeping
    KB_INDEX_KEEP_PREVIOUS versions below each generation's served one. stderr: the
    chunks collected."""
    from services.indexer.gc.settings import GcSettings
    from services.indexer.pool import load_settings
    from services.runtime.logging import configure_logging

    settings = load_settings()
    collecting = cli_support.load_settings(GcSettings)
    configure_logging(settings.log_level, settings.log_format, service="indexer")

    async def _work(pool: asyncpg.Pool[Any]) -> tuple[int, int]:
        from services.indexer.gc.collector import GarbageCollector

        collector = GarbageCollector(pool, collecting)
        clean = chunks = 0
        while True:
            done = await collector.collect(max_documents=max_documents)
            clean += done.clean
            chunks += done.chunks
            if done.documents == 0:
                return clean, chunks

    from services.indexer.pool import with_pool

    clean, chunks = with_pool(settings, 1, _work)
    typer.echo(f"index gc: {chunks} chunks collected, {clean} documents clean", err=True)


@index_app.command("retention")
def retention() -> None:
    """Remove superseded versions' content now (`kb indexer run` does it every
    KB_RETENTION_INTERVAL_SECONDS): the bytes and chunks of versions superseded for
    KB_RETENTION_SUPERSEDED_DAYS by the database's clock (0: keep forever), never a served,
    published or in-flight version's. stderr: what was removed."""
    from services.indexer.gc.retention import RetentionCollector, RetentionPass
    from services.indexer.gc.settings import RetentionSettings
    from services.indexer.pool import load_settings, with_pool
    from services.runtime.logging import configure_logging

    settings = load_settings()
    retaining = cli_support.load_settings(RetentionSettings)
    configure_logging(settings.log_level, settings.log_format, service="indexer")

    async def _work(pool: asyncpg.Pool[Any]) -> RetentionPass:
        return await RetentionCollector(pool, retaining).collect()

    done = with_pool(settings, 1, _work)
    typer.echo(
        f"index retention: {done.versions} versions' content removed ({done.bytes} bytes,"
        f" {done.chunks} chunks), keeping {retaining.superseded_days} days",
        err=True,
    )


@index_app.command("tenant-graphs")
def tenant_graphs(
    min_chunks: int | None = typer.Option(
        None,
        "--min-chunks",
        min=1,
        help="Tenants of at least this many chunks (default KB_INDEXER_TENANT_GRAPH_MIN_CHUNKS).",
    ),
) -> None:
    """Build the HNSW graph of each tenant large enough to have its own, for every model
    the search pointers serve it by, now (`kb indexer run` does it every
    KB_INDEXER_TENANT_GRAPH_CHECK_SECONDS): after a bulk load, say."""
    from services.indexer.pool import load_settings
    from services.runtime.logging import configure_logging

    settings = load_settings()
    configure_logging(settings.log_level, settings.log_format, service="indexer")
    threshold = min_chunks if min_chunks is not None else settings.indexer_tenant_graph_min_chunks

    async def _work(pool: asyncpg.Pool[Any]) -> bool:
        from services.indexer.sink.tenant_graphs import PgTenantGraphs

        graphs = PgTenantGraphs(
            pool, min_chunks=threshold, index_build_memory=settings.indexer_index_build_memory
        )
        done = True
        # The indexers' round, now: the models whose pointers give a tenant past the size.
        for model, dimension, large in await graphs.large_by_model():
            built = await graphs.ensure_tenants(model, dimension, large)
            if built is None:
                typer.echo(f"tenant graphs of {model}: another process is building them", err=True)
                done = False
                continue
            for tenant in built:
                typer.echo(f"built  {model}  {tenant}")
            typer.echo(f"tenant graphs of {model}: {len(built)} built", err=True)
            # A build that failed (logged, tenant_graph.build_failed) or was not tried.
            if without := await graphs.missing(model):
                typer.echo(
                    f"tenant graphs of {model}: {len(without)} tenants still have none ("
                    + ", ".join(without[:20])
                    + ")",
                    err=True,
                )
                done = False
        return done

    from services.indexer.pool import with_pool

    if not with_pool(settings, 1, _work):
        raise typer.Exit(cli_support.EXIT_FAILURE)


@partition_graphs_app.callback()
def _partition_graphs() -> None:
    """The models' partitioned HNSW indexes (one graph per partition of knowledge_chunk)."""


@partition_graphs_app.command("drop")
def drop_partition_graphs(
    model: str | None = typer.Option(
        None,
        "--model",
        help="Only this model's (default: every registered or live generation's model's).",
    ),
) -> None:
    """Drop a model's partitioned HNSW index, left by indexers that ran with
    KB_INDEXER_PARTITION_GRAPHS on: every chunk write keeps paying an insert into it until
    then. Refused for a model while a tenant at or over KB_INDEXER_TENANT_GRAPH_MIN_CHUNKS
    has no valid graph of its own (`kb index tenant-graphs` builds them)."""
    from services.index.ann import check_model_name
    from services.indexer.pool import load_settings
    from services.runtime.logging import configure_logging

    settings = load_settings()
    configure_logging(settings.log_level, settings.log_format, service="indexer")
    if settings.indexer_partition_graphs:
        raise ConfigError(
            "KB_INDEXER_PARTITION_GRAPHS is true: the indexers would build the partition "
            "graphs again; set it to false on every indexer first"
        )
    min_chunks = settings.indexer_tenant_graph_min_chunks
    if min_chunks <= 0:
        raise ConfigError(
            "KB_INDEXER_TENANT_GRAPH_MIN_CHUNKS is 0 (no tenant graphs): without the partition "
            "graphs no search would walk a graph; set it first"
        )
    if model is not None:
        try:
            check_model_name(model)
        except ValueError as error:
            raise BadInput(str(error)) from None

    async def _work(pool: asyncpg.Pool[Any]) -> bool:
        from services.indexer.maintenance.partition_graphs import RERUN, PgPartitionGraphs

        graphs = PgPartitionGraphs(pool, min_chunks=min_chunks)
        done = True
        for name in [model] if model is not None else await graphs.models():
            outcome = await graphs.drop(name)
            if outcome.busy:
                done = False
                typer.echo(
                    f"partition graphs of {name}: another process is building its graphs; "
                    f"run `{RERUN}` again later",
                    err=True,
                )
            elif outcome.dropped or outcome.leftovers:
                if outcome.dropped:
                    typer.echo(f"dropped  {name}  {outcome.index}")
                for index in outcome.leftovers:
                    typer.echo(f"dropped  {name}  {index}  (unattached part)")
                typer.echo(
                    f"partition graphs of {name}: dropped"
                    + (f", {len(outcome.leftovers)} unattached parts" if outcome.leftovers else ""),
                    err=True,
                )
            elif outcome.missing:
                done = False
                typer.echo(
                    f"partition graphs of {name}: kept, {len(outcome.missing)} tenants of at "
                    f"least {min_chunks} chunks have no graph of their own ("
                    + ", ".join(outcome.missing[:20])
                    + f"): run `kb index tenant-graphs`, then `{RERUN}` again",
                    err=True,
                )
            else:
                typer.echo(f"partition graphs of {name}: none", err=True)
        return done

    from services.indexer.pool import with_pool

    if not with_pool(settings, 1, _work):
        raise typer.Exit(cli_support.EXIT_FAILURE)


def _line(drift: Drift) -> str:
    state = drift.state
    return f"{drift.kind}  {state.tenant_id}  {state.document_id}  {drift.detail}"
