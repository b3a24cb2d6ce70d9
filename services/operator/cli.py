"""`kb operators create NAME`: an operator key for the /ui page (only its hash is stored)."""

from __future__ import annotations

import re

import typer

from services.runtime.errors import BadInput

operators_app = typer.Typer(help="Operator keys for the /ui page.", no_args_is_help=True)

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,99}$")


@operators_app.command("create")
def create_operator(
    name: str = typer.Argument(help="Who the key is for (letters, digits, . _ @ -; max 100)."),
) -> None:
    """Create an operator key; print it as KB_OPERATOR_KEY=<key> (only its hash is stored)."""
    if not _NAME.match(name):
        raise BadInput(f"operator name {name!r}: letters, digits, '.', '_', '@', '-', max 100")

    from services.operator.auth import digest, new_operator_key
    from services.operator.settings import OperatorSettings
    from services.operator.store_pg import PgOperatorStore
    from services.runtime.commands.cli_support import run_async
    from services.runtime.errors import Conflict
    from services.runtime.pg.db import create_pool

    settings = OperatorSettings()
    key = new_operator_key()

    async def _create() -> None:
        pool = await create_pool(settings, min_size=1, max_size=1)
        try:
            await PgOperatorStore(pool).create_operator_key(name, digest(key))
        except Conflict as error:
            raise BadInput(f"an operator named {name!r} exists already") from error
        finally:
            await pool.close()

    run_async(_create())
    typer.echo(f"KB_OPERATOR_KEY={key}")
