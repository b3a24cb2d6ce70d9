"""`kb dev up|down|status`.

stdout carries only ``DATABASE_URL=...``, ``KAFKA_BOOTSTRAP_SERVERS=...`` and, with
replicas, ``KB_SEARCH_DATABASE_URLS=...`` lines so that ``eval "$(kb dev up)"`` works;
everything meant for people goes to stderr.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from kbtools.devstack.kafka import LocalKafka
from kbtools.devstack.postgres import EmbeddedPostgres, ServiceStatus
from kbtools.devstack.replicas import (
    EmbeddedReplica,
    describe,
    present_replicas,
    replica_lags,
    replicas,
)
from kbtools.devstack.settings import DevStackSettings

app = typer.Typer(
    help="Run the embedded PostgreSQL + pgvector and a local Kafka broker.", no_args_is_help=True
)

MAX_REPLICAS = 8


def _print_env(statuses: list[ServiceStatus]) -> None:
    names = {"postgres": "DATABASE_URL", "kafka": "KAFKA_BOOTSTRAP_SERVERS"}
    for status in statuses:
        if status.running and status.url and status.name in names:
            typer.echo(f"{names[status.name]}={status.url}")
    replica_urls = [s.url for s in statuses if s.name.startswith("replica-") and s.running]
    if replica_urls:
        typer.echo(f"KB_SEARCH_DATABASE_URLS={','.join(u for u in replica_urls if u)}")


def _report(statuses: list[ServiceStatus]) -> None:
    for status in statuses:
        typer.echo(f"{status.name:<9} {status.state:<8} {status.detail}", err=True)


def _replica_statuses(
    settings: DevStackSettings, running: list[EmbeddedReplica]
) -> list[ServiceStatus]:
    lags = replica_lags(settings.pg_port)
    return [describe(r.status(), lags.get(r.application_name)) for r in running]


@app.command()
def up(
    replica_count: Annotated[
        int | None,
        typer.Option(
            "--replicas",
            min=0,
            max=MAX_REPLICAS,
            help="Run this many streaming replicas of the PostgreSQL (search reads them: "
            "KB_SEARCH_DATABASE_URLS); replicas beyond it are stopped. Default: leave them.",
        ),
    ] = None,
) -> None:
    """Start both services (idempotent) and print their URLs."""
    settings = DevStackSettings()
    kafka_launcher = LocalKafka(settings)
    # Fail on a missing java/mvn before anything starts, not halfway through.
    kafka_launcher.preflight()
    typer.echo(f"starting postgres on 127.0.0.1:{settings.pg_port} ...", err=True)
    postgres = EmbeddedPostgres(settings).up()
    wanted = replicas(settings, replica_count or 0)
    if replica_count is not None:
        for extra in present_replicas(settings)[replica_count:]:
            typer.echo(f"stopping {extra.name} ...", err=True)
            extra.down()
    for replica in wanted:
        typer.echo(f"starting {replica.name} on 127.0.0.1:{replica.port} ...", err=True)
        replica.up()
    typer.echo(f"starting kafka on 127.0.0.1:{settings.kafka_port} ...", err=True)
    kafka = kafka_launcher.up()
    shown = wanted if replica_count is not None else _running(present_replicas(settings))
    statuses = [postgres, *_replica_statuses(settings, shown), kafka]
    _report(statuses)
    _print_env(statuses)


def _running(found: list[EmbeddedReplica]) -> list[EmbeddedReplica]:
    return [replica for replica in found if replica.status().running]


@app.command()
def down() -> None:
    """Stop every service cleanly, replicas included (their data stays for the next `up`)."""
    settings = DevStackSettings()
    LocalKafka(settings).down()
    for replica in present_replicas(settings):
        replica.down()
    EmbeddedPostgres(settings).down()
    typer.echo("postgres, its replicas and kafka stopped", err=True)


@app.command()
def status() -> None:
    """Tell what runs and where, each replica's lag included; exit 1 when a service is not
    running (a replica that was started and stopped counts)."""
    settings = DevStackSettings()
    statuses = [
        EmbeddedPostgres(settings).status(),
        *_replica_statuses(settings, present_replicas(settings)),
        LocalKafka(settings).status(),
    ]
    _report(statuses)
    _print_env(statuses)
    # A replica stopped by `kb dev up --replicas` with a smaller count is no failure.
    if not all(
        s.running or (s.name.startswith("replica-") and s.state == "stopped") for s in statuses
    ):
        sys.exit(1)
