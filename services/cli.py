"""The `kb` entry point: one command, a sub-command per job, `--help` on every one."""

from __future__ import annotations

import sys

import typer
from pydantic import ValidationError

from services.devstack.cli import app as dev_app
from services.indexer.cli import indexer_app, tasks_app
from services.publisher.cli import tenants_app
from services.relay.cli import app as relay_app
from services.runtime.cli import migrate
from services.runtime.cli_support import fail
from services.runtime.errors import ConfigError, KbError
from services.serve import serve

app = typer.Typer(
    help="kb-pipeline: from published to searchable, reliably.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.add_typer(dev_app, name="dev")
app.command("migrate")(migrate)
app.add_typer(indexer_app, name="indexer")
app.add_typer(tasks_app, name="tasks")
app.add_typer(relay_app, name="relay")
app.add_typer(tenants_app, name="tenants")
app.command("serve")(serve)


def _describe(error: ValidationError) -> str:
    problems = [
        f"{'.'.join(str(p) for p in e['loc']) or 'value'}: {e['msg']}" for e in error.errors()
    ]
    return "invalid configuration: " + "; ".join(problems)


def main() -> None:
    try:
        app()
    except KbError as error:
        fail(error)
    except ValidationError as error:
        # Settings read from the environment (or options) that do not validate.
        fail(ConfigError(_describe(error)))
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
