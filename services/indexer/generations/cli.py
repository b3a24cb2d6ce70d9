"""`kb index generations create|list|status|switch|retire` (docs/operations.md, "Changing the
embedding model").

stdout carries the answer (the new generation's id, one line per generation, the documents a
switch would leave unsearchable); stderr the summary. Exit 0 on success, 2 on bad input
(nothing changed), 1 on any other failure.
"""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Annotated, Any

import typer

from services.indexer.generations.model import (
    AnnIndexBuild,
    GenerationSpec,
    GenerationStatus,
    SwitchRefused,
    human_bytes,
    tenant_ids,
)
from services.runtime.errors import BadInput

if TYPE_CHECKING:
    import asyncpg

    from services.indexer.generations.store_pg import PgGenerations
    from services.indexer.settings import IndexerSettings

# The report line of the model's partitioned HNSW index (one graph per partition).
_ANN_INDEX = {
    AnnIndexBuild.BUILT: "built",
    AnnIndexBuild.PRESENT: "there already",
    AnnIndexBuild.BUSY: "another process is building them",
    AnnIndexBuild.OFF: "off (KB_INDEXER_PARTITION_GRAPHS)",
}

generations_app = typer.Typer(
    help="Build a tenant's index with another embedding model beside the served one, "
    "switch its search to it, roll back, retire.",
    no_args_is_help=True,
)


def _run(settings: IndexerSettings, work: Any) -> Any:
    from services.indexer.generations.store_pg import PgGenerations
    from services.indexer.pool import with_pool

    async def _work(pool: asyncpg.Pool[Any]) -> Any:
        store = PgGenerations(
            pool,
            index_build_memory=settings.indexer_index_build_memory,
            partition_graphs=settings.indexer_partition_graphs,
        )
        return await work(store)

    return with_pool(settings, 1, _work)


def _settings() -> IndexerSettings:
    """The indexer's settings, with logs configured (they go to stderr: stdout is the
    answer)."""
    from services.indexer.pool import load_settings
    from services.runtime.logging import configure_logging

    settings = load_settings()
    configure_logging(settings.log_level, settings.log_format, service="indexer")
    return settings


@generations_app.callback()
def _group() -> None:
    """Build a tenant's index with another embedding model beside the served one, switch
    its search to it, roll back, retire."""


@generations_app.command("create")
def create(
    provider: str = typer.Option(
        ...,
        "--provider",
        help="The embedding profile: default, or <name> of KB_EMBEDDING_PROFILE_<NAME>_*.",
    ),
    model: str = typer.Option(..., "--model", help="The embedding model."),
    dimensions: int = typer.Option(..., "--dimensions", help="Its vector size."),
    chunk_tokens: int | None = typer.Option(
        None, "--chunk-tokens", help="Tokens per chunk (default KB_INDEXER_CHUNK_MAX_TOKENS)."
    ),
    chunk_overlap: int | None = typer.Option(
        None, "--chunk-overlap", help="Overlap tokens (default KB_INDEXER_CHUNK_OVERLAP_TOKENS)."
    ),
    tenant: Annotated[
        list[str] | None,
        typer.Option("--tenant", help="A tenant to build it for (repeatable)."),
    ] = None,
    all_tenants: bool = typer.Option(False, "--all", help="Build it for every tenant."),
) -> None:
    """Register a generation and enqueue the backfill of every searchable document of the
    tenants (below their new publishes); from now on every publish is indexed into it as
    well. Prints its id. Running it again adds only what is missing."""
    from services.embedding.profiles import load_profile, settings_for_generation

    if bool(tenant) == all_tenants:
        raise BadInput("name the tenants: --tenant T (repeatable) or --all")
    wanted = None if all_tenants else tenant_ids(tenant or [])
    settings = _settings()
    spec = GenerationSpec(
        provider,
        model,
        dimensions,
        settings.indexer_chunk_max_tokens if chunk_tokens is None else chunk_tokens,
        settings.indexer_chunk_overlap_tokens if chunk_overlap is None else chunk_overlap,
    )
    # Before anything is written: the profile is configured here and can serve the model
    # (the indexers and the API read the same variables).
    load_profile(spec.provider_profile)
    settings_for_generation(spec.candidate())

    async def _work(store: PgGenerations) -> Any:
        outcome = await store.create(spec, wanted, max_attempts=settings.indexer_max_attempts)
        ann_index = await store.ensure_ann_index(outcome.generation)
        graphs = await store.tenant_graphs(
            outcome.generation, wanted, min_chunks=settings.indexer_tenant_graph_min_chunks
        )
        return dataclasses.replace(outcome, ann_index=ann_index, tenant_graphs=graphs)

    outcome = _run(settings, _work)
    generation = outcome.generation
    typer.echo(generation.generation_id)
    verb = "created" if outcome.created else "found (already created)"
    typer.echo(
        f"{generation.describe()} {verb}: {len(outcome.added)} tenants added, "
        f"{len(outcome.pinned)} pinned to the default, {outcome.backfill_tasks} backfill "
        "tasks enqueued",
        err=True,
    )
    typer.echo(
        f"partition graphs of {generation.embedding_model}: {_ANN_INDEX[outcome.ann_index]}",
        err=True,
    )
    if outcome.tenant_graphs is None:
        typer.echo(
            f"tenant graphs of {generation.embedding_model}: another process is building them "
            "(`kb index tenant-graphs` builds them once the tenants are switched)",
            err=True,
        )
    elif outcome.tenant_graphs:
        typer.echo(
            f"tenant graphs of {generation.embedding_model}: built for "
            + ", ".join(outcome.tenant_graphs),
            err=True,
        )


@generations_app.command("list")
def list_generations() -> None:
    """One line per generation: id, profile, model, dimension, chunk tokens, state, default,
    tenants served / built in it."""
    summaries = _run(_settings(), lambda store: store.summaries())
    for s in summaries:
        g = s.generation
        typer.echo(
            f"{g.generation_id}  {g.provider_profile}  {g.embedding_model}  {g.dimension}  "
            f"{g.chunk_max_tokens}/{g.chunk_overlap_tokens}  {g.state}  "
            f"{'default' if g.is_default else '-'}  serving={s.tenants_serving}  "
            f"built={s.tenants_built}"
        )


@generations_app.command("status")
def status(
    tenant: str | None = typer.Option(None, "--tenant", help="Only this tenant's documents."),
    as_json: bool = typer.Option(False, "--json", help="As JSON."),
) -> None:
    """Per generation not retired: documents done / pending / failed, chunks, size on disk,
    the tenants it serves."""
    wanted = None if tenant is None else tenant_ids([tenant])[0]
    found: list[GenerationStatus] = _run(
        _settings(), lambda store: store.status(wanted, on_disk=True)
    )
    if as_json:
        typer.echo(json.dumps([_as_json(s) for s in found], indent=2, sort_keys=True))
        return
    for s in found:
        g, p = s.summary.generation, s.progress
        size = "-" if s.bytes_on_disk is None else human_bytes(s.bytes_on_disk)
        typer.echo(
            f"{g.generation_id}  {g.embedding_model}  {g.state}  done={p.done} "
            f"pending={p.pending} failed={p.failed} ({p.percent:.1f}%)  "
            f"chunks={s.chunks_on_disk} size={size}  serving={s.summary.tenants_serving}"
            + (f" ({', '.join(s.serving)})" if s.serving else "")
        )


def _as_json(s: GenerationStatus) -> dict[str, Any]:
    """One generation's status, its keys in camelCase as the HTTP API's are."""
    g, p = s.summary.generation, s.progress
    fields = {
        **dataclasses.asdict(g),
        "done": p.done,
        "pending": p.pending,
        "failed": p.failed,
        "percent": round(p.percent, 1),
        "chunks": s.chunks_on_disk,
        "bytes": s.bytes_on_disk,
        "tenants_serving": s.summary.tenants_serving,
        "tenants_built": s.summary.tenants_built,
        "serving": s.serving,
    }
    return {_camel(name): value for name, value in fields.items()}


def _camel(name: str) -> str:
    first, *rest = name.split("_")
    return first + "".join(part.title() for part in rest)


@generations_app.command("switch")
def switch(
    tenant: str = typer.Option(..., "--tenant", help="The tenant whose search moves."),
    to: int = typer.Option(..., "--to", help="The generation's id."),
    force: bool = typer.Option(
        False,
        "--force",
        help="Switch although documents are missing from it: they are named, and are not "
        "searchable until the generation holds them.",
    ),
) -> None:
    """Move the tenant's search to the generation in one transaction: refused (exit 2, the
    missing documents on stdout) unless it holds the served version of every searchable
    document. Rolling back is the same command with the previous generation."""
    wanted = tenant_ids([tenant])[0]
    try:
        outcome = _run(_settings(), lambda store: store.switch(wanted, to, force=force))
    except SwitchRefused as refused:
        for missing in refused.missing:
            typer.echo(missing.line())
        if refused.total > len(refused.missing):
            typer.echo(f"... and {refused.total - len(refused.missing)} more")
        raise
    if not outcome.switched:
        typer.echo(f"tenant {wanted}: served by generation {to} already", err=True)
        return
    for dropped in outcome.dropped:
        typer.echo(f"unsearchable until built: {dropped.line()}")
    if outcome.dropped_total > len(outcome.dropped):
        typer.echo(f"... and {outcome.dropped_total - len(outcome.dropped)} more")
    typer.echo(
        f"tenant {wanted}: served by generation {to} (was {outcome.previous}): "
        f"{outcome.rewritten} pointers rewritten, {outcome.dropped_total} dropped",
        err=True,
    )


@generations_app.command("retire")
def retire(generation_id: int = typer.Argument(..., help="The generation's id.")) -> None:
    """Delete a generation no tenant is served by (never the default): its chunks, rows and
    tasks in batches, and its model's indexes when no other generation uses the model. Safe
    to run again after an interruption."""
    outcome = _run(_settings(), lambda store: store.retire(generation_id))
    if outcome.already_retired:
        typer.echo(f"generation {generation_id}: retired already", err=True)
        return
    typer.echo(
        f"generation {generation_id} retired: {outcome.chunks_deleted} chunks, "
        f"{outcome.document_rows_deleted} document rows and {outcome.tasks_deleted} tasks "
        f"deleted ({outcome.tasks_ended} unfinished), {len(outcome.indexes_dropped)} indexes "
        "dropped",
        err=True,
    )
