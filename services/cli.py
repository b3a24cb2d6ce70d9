"""The `kb` entry point: one command, a sub-command per job, `--help` on every one.

Sub-commands are imported when they run (or show their own help), never before: `kb
--help` lists them from the one-line summaries below without importing a driver or the web
stack, so every invocation starts in the time Python and typer take.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, NamedTuple

import typer
from typer.core import TyperCommand, TyperGroup


class LazyCommand(NamedTuple):
    module: str
    attribute: str  # a typer.Typer (a group of commands) or a command function
    summary: str  # what `kb --help` shows; a unit test holds it to the command's own help


COMMANDS: dict[str, LazyCommand] = {
    "dev": LazyCommand(
        "kbtools.devstack.cli",
        "app",
        "Run the embedded PostgreSQL + pgvector and a local Kafka broker.",
    ),
    "migrate": LazyCommand(
        "services.runtime.commands.cli",
        "migrate",
        "Apply pending migrations under an advisory lock (safe to run from several places).",
    ),
    "indexer": LazyCommand(
        "services.indexer.cli",
        "indexer_app",
        "Index workers: claim due tasks of one tier and index them.",
    ),
    "tasks": LazyCommand(
        "services.indexer.cli", "tasks_app", "Inspect index tasks and requeue DEAD ones."
    ),
    "index": LazyCommand(
        "services.indexer.maintenance.cli",
        "index_app",
        "Check the search index against what was published, and repair it.",
    ),
    "relay": LazyCommand("services.relay.cli", "app", "Carry committed outbox rows to Kafka."),
    "ingest": LazyCommand(
        "services.publisher.ingest.cli", "app", "Apply producers' signed commands from Kafka."
    ),
    "tenants": LazyCommand("services.publisher.cli", "tenants_app", "Tenants and their API keys."),
    "documents": LazyCommand(
        "services.publisher.documents_cli",
        "documents_app",
        "A tenant's documents: delete or erase one.",
    ),
    "operators": LazyCommand(
        "services.operator.cli", "operators_app", "Operator keys for the /ui page."
    ),
    "serve": LazyCommand("services.serve", "serve", "Run the HTTP API (publishing and search)."),
    "chaos": LazyCommand(
        "kbtools.chaos.cli",
        "chaos_app",
        "Run the system under many faults at once and check every invariant.",
    ),
    "demo": LazyCommand(
        "kbtools.demo.cli",
        "demo",
        "Tell the refund-policy story on the embedded default and leave the services running.",
    ),
}


def load_command(name: str) -> Any:
    """The click command behind ``kb <name>`` (imports its module)."""
    spec = COMMANDS[name]
    target = getattr(importlib.import_module(spec.module), spec.attribute)
    command: Any
    if isinstance(target, typer.Typer):
        command = typer.main.get_group(target)
    else:
        single = typer.Typer(add_completion=False)
        single.command(name)(target)
        command = typer.main.get_command(single)
    command.name = name
    _plain_help(command)
    return command


def _plain_help(command: Any) -> None:
    """Render help without rich, like `kb --help`: rich (and what typer loads with it)
    would cost more than everything else `kb <command> --help` does."""
    if hasattr(command, "rich_markup_mode"):
        command.rich_markup_mode = None
    for sub in getattr(command, "commands", {}).values():
        _plain_help(sub)


class LazyGroup(TyperGroup):
    """A typer group whose sub-commands are imported on use. While it formats its own help
    it lists stand-ins carrying the summaries, so listing imports nothing."""

    _listing = False

    def list_commands(self, ctx: Any) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        if cmd_name not in COMMANDS:
            return None
        if self._listing:
            return TyperCommand(name=cmd_name, help=COMMANDS[cmd_name].summary)
        return load_command(cmd_name)

    def format_help(self, ctx: Any, formatter: Any) -> None:
        self._listing = True
        try:
            super().format_help(ctx, formatter)
        finally:
            self._listing = False


app = typer.Typer(
    cls=LazyGroup,
    help="kb-pipeline: from published to searchable, reliably.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    # Plain help text: rendering with rich would import it, and pay for that, on every --help.
    rich_markup_mode=None,
)


@app.callback()
def _root() -> None:
    """kb-pipeline: from published to searchable, reliably."""


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as error:
        # Every command's errors end here: credentials masked, one line for a known error
        # (settings that do not validate are named without their values), exit 2 or 1.
        from services.runtime.commands.cli_support import fail

        fail(error)


if __name__ == "__main__":
    main()
