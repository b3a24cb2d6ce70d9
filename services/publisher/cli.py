"""`kb tenants create`, and `kb tenants keys ...` / `kb tenants verification-keys ...`
(services/publisher/keys/cli.py). `kb serve` is services/serve.py: it serves the composed app.

Imports of drivers happen inside the command: `kb --help` does not pay for them.
"""

from __future__ import annotations

import re
from typing import Final

import typer

from services.publisher.ingest.cli import ingest_keys_app
from services.publisher.keys.cli import keys_app
from services.publisher.keys.verification_cli import verification_keys_app
from services.runtime.errors import BadInput

TIER_PATTERN: Final = r"^[a-z0-9][a-z0-9_-]{0,31}$"

tenants_app = typer.Typer(help="Tenants and their API keys.", no_args_is_help=True)
tenants_app.add_typer(keys_app, name="keys")
tenants_app.add_typer(verification_keys_app, name="verification-keys")
tenants_app.add_typer(ingest_keys_app, name="ingest-keys")


@tenants_app.command("create")
def create_tenant(
    name: str = typer.Argument(help="Tenant id: lowercase letters, digits and '-' (max 63)."),
    tier: str = typer.Option(..., "--tier", help="Indexing tier, e.g. standard or premium."),
) -> None:
    """Create a tenant; print its first API key (an admin key) as KB_API_KEY=<key> (only its
    hash is stored)."""
    from services.publisher.settings import PublisherSettings
    from services.publisher.store_pg import PgTenantStore
    from services.runtime.commands.cli_support import load_settings, run_async
    from services.runtime.logging import configure_logging, get_logger
    from services.runtime.pg.db import connection
    from services.runtime.tenancy.tenant_auth import hash_api_key, new_api_key
    from services.runtime.tenancy.tenant_ids import TENANT_ID_PATTERN

    if not re.fullmatch(TENANT_ID_PATTERN, name):
        raise BadInput(
            f"tenant name {name!r} is invalid: use 1-63 lowercase letters, digits and '-', "
            "starting with a letter or digit",
            code="TENANT_NAME_INVALID",
        )
    if not re.fullmatch(TIER_PATTERN, tier):
        raise BadInput(
            f"tier {tier!r} is invalid: use 1-32 lowercase letters, digits, '-' and '_'",
            code="TIER_INVALID",
        )
    settings = load_settings(PublisherSettings)
    configure_logging(settings.log_level, settings.log_format, service="kb-tenants")
    key = new_api_key(name)

    async def _run() -> None:
        async with connection(settings) as conn:
            await PgTenantStore(conn).create_tenant(name, tier, hash_api_key(key))

    run_async(_run())
    get_logger(__name__).info("tenant.created", tenant_id=name, tier=tier)
    typer.echo(f"KB_API_KEY={key}")
