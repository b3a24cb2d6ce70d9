"""`kb chaos run`: the invariants proven together, under many faults at once."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Annotated

import typer

chaos_app = typer.Typer(
    help="Run the system under many faults at once and check every invariant.",
    no_args_is_help=True,
    add_completion=False,
)


@chaos_app.command("run")
def run_command(
    seed: Annotated[int, typer.Option(help="Replays the same fault schedule.")] = 1,
    documents: Annotated[int, typer.Option(min=1, help="Documents to publish.")] = 200,
    minutes: Annotated[float, typer.Option(min=0.1, help="How long the load lasts.")] = 2.0,
    faults: Annotated[
        int,
        typer.Option(
            min=13,
            help="Faults to inject (every kind at least once), besides the ingest "
            "consumers' kills (one per ten faults, at least one each).",
        ),
    ] = 20,
    home: Annotated[Path, typer.Option(help="Where the run's servers, logs and state go.")] = Path(
        ".kb/chaos"
    ),
    pg_port: Annotated[
        int | None, typer.Option(help="The run's own PostgreSQL port (default: a free one).")
    ] = None,
    kafka_port: Annotated[
        int | None, typer.Option(help="The run's own Kafka port (default: a free one).")
    ] = None,
    replica_port: Annotated[
        int | None,
        typer.Option(help="The port of the run's streaming replica (default: a free one)."),
    ] = None,
    keep: Annotated[bool, typer.Option(help="Leave everything running afterwards.")] = False,
) -> None:
    """Start PostgreSQL, Kafka and every kb process, publish documents while killing and
    stopping them on a seeded schedule, then check the invariants. Exit 1 on a violation."""
    from kbtools.chaos.runner import ChaosOptions, run

    options = ChaosOptions(
        seed=seed,
        documents=documents,
        minutes=minutes,
        faults=faults,
        home=home.resolve(),
        pg_port=pg_port,
        kafka_port=kafka_port,
        replica_port=replica_port,
        keep=keep,
    )
    command = "kb chaos run " + shlex.join(sys.argv[sys.argv.index("run") + 1 :])
    outcome = run(options, command, say=lambda line: print(line, flush=True))
    raise typer.Exit(0 if outcome.passed else 1)
