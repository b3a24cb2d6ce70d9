"""The `kb` entry point: one command, a sub-command per job, `--help` on every one."""

from __future__ import annotations

import sys

import typer

from services.devstack.cli import app as dev_app
from services.runtime.cli import migrate
from services.runtime.cli_support import fail
from services.runtime.errors import KbError

app = typer.Typer(
    help="kb-pipeline: from published to searchable, reliably.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.add_typer(dev_app, name="dev")
app.command("migrate")(migrate)


def main() -> None:
    try:
        app()
    except KbError as error:
        fail(error)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
