"""`kb migrate`."""

from __future__ import annotations

import typer

from services.runtime.commands.cli_support import run_async
from services.runtime.pg.db import connection
from services.runtime.pg.migrations import MigrationReport, apply_migrations
from services.runtime.settings import RuntimeSettings


def migrate() -> None:
    """Apply pending migrations under an advisory lock (safe to run from several places)."""

    async def _run() -> MigrationReport:
        async with connection(RuntimeSettings()) as conn:
            return await apply_migrations(conn)

    report = run_async(_run())
    for migration in report.applied:
        typer.echo(f"applied {migration.version:04d}_{migration.name}", err=True)
    typer.echo(
        f"schema is current: {len(report.applied)} applied, "
        f"{len(report.already_applied)} already there",
        err=True,
    )
