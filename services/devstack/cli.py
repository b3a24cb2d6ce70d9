"""`kb dev up|down|status`.

stdout carries only ``DATABASE_URL=...`` and ``KAFKA_BOOTSTRAP_SERVERS=...`` lines so that
``eval "$(kb dev up)"`` works; everything meant for people goes to stderr.
"""

from __future__ import annotations

import sys

import typer

from services.devstack.kafka import LocalKafka
from services.devstack.postgres import EmbeddedPostgres, ServiceStatus
from services.devstack.settings import DevStackSettings

app = typer.Typer(
    help="Run the embedded PostgreSQL + pgvector and a local Kafka broker.", no_args_is_help=True
)


def _print_env(statuses: list[ServiceStatus]) -> None:
    names = {"postgres": "DATABASE_URL", "kafka": "KAFKA_BOOTSTRAP_SERVERS"}
    for status in statuses:
        if status.running and status.url:
            typer.echo(f"{names[status.name]}={status.url}")


def _report(statuses: list[ServiceStatus]) -> None:
    for status in statuses:
        typer.echo(f"{status.name:<9} {status.state:<8} {status.detail}", err=True)


@app.command()
def up() -> None:
    """Start both services (idempotent) and print their URLs."""
    settings = DevStackSettings()
    kafka_launcher = LocalKafka(settings)
    # Fail on a missing java/mvn before anything starts, not halfway through.
    kafka_launcher.preflight()
    typer.echo(f"starting postgres on 127.0.0.1:{settings.pg_port} ...", err=True)
    postgres = EmbeddedPostgres(settings).up()
    typer.echo(f"starting kafka on 127.0.0.1:{settings.kafka_port} ...", err=True)
    kafka = kafka_launcher.up()
    _report([postgres, kafka])
    _print_env([postgres, kafka])


@app.command()
def down() -> None:
    """Stop both services cleanly (their data stays for the next `up`)."""
    settings = DevStackSettings()
    LocalKafka(settings).down()
    EmbeddedPostgres(settings).down()
    typer.echo("postgres and kafka stopped", err=True)


@app.command()
def status() -> None:
    """Tell what runs and where; exit 1 when a service is not running."""
    settings = DevStackSettings()
    statuses = [EmbeddedPostgres(settings).status(), LocalKafka(settings).status()]
    _report(statuses)
    _print_env(statuses)
    if not all(s.running for s in statuses):
        sys.exit(1)
