"""`kb tenants keys create|list|revoke|rotate` (docs/security.md); the verification keys of
principal tokens are verification_cli.py.

A new key is printed once, as ``KB_API_KEY_ID=<id>`` and ``KB_API_KEY=<key>`` (eval-able);
only its SHA-256 is stored. Drivers are imported inside the commands, so `kb --help` does
not pay for them.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Annotated, Any, Final

import typer

from services.runtime.errors import BadInput

MAX_GRACE_SECONDS: Final = 30 * 86_400

keys_app = typer.Typer(
    help="A tenant's API keys: scopes, principals, revocation, rotation.", no_args_is_help=True
)

TENANT_ARG = typer.Argument(help="The tenant id.")


def check_tenant(tenant: str) -> None:
    from services.runtime.tenancy.tenant_ids import TENANT_ID_PATTERN

    if not re.fullmatch(TENANT_ID_PATTERN, tenant):
        raise BadInput(f"tenant name {tenant!r} is invalid", code="TENANT_NAME_INVALID")


def _key_id(value: str) -> uuid.UUID:
    try:
        return uuid.UUID(value)
    except ValueError:
        raise BadInput(f"{value!r} is not a key id (a UUID)", code="KEY_ID_INVALID") from None


def run_with_connection(work: Any) -> Any:
    """Run ``work(conn)`` on one connection of the configured database."""
    from services.publisher.settings import PublisherSettings
    from services.runtime.commands.cli_support import load_settings, run_async
    from services.runtime.logging import configure_logging
    from services.runtime.pg.db import connection

    settings = load_settings(PublisherSettings)
    configure_logging(settings.log_level, settings.log_format, service="kb-tenants")

    async def _go() -> Any:
        async with connection(settings) as conn:
            return await work(conn)

    return run_async(_go())


def key_spec(
    scopes: list[str], principals: list[str], require_token: bool, name: str | None
) -> Any:
    """The :class:`KeySpec` a command line asks for, or :class:`BadInput` saying why not."""
    from services.publisher.keys.store_pg import KeySpec
    from services.runtime.auth.keys import PrincipalSource, Scope, parse_scopes
    from services.runtime.tenancy.principals import normalise_principals

    try:
        parsed = parse_scopes(scopes)
    except ValueError as error:
        raise BadInput(str(error), code="KEY_SCOPE_INVALID") from None
    if not parsed:
        raise BadInput(
            "name at least one --scope: publish, search or admin", code="KEY_SCOPE_INVALID"
        )
    if name is not None and not 1 <= len(name) <= 100:
        raise BadInput("a key's --name has 1 to 100 characters", code="KEY_NAME_INVALID")
    fixed = normalise_principals(p for value in principals for p in value.split(","))
    if principals and not fixed:
        raise BadInput("--principals names no principal", code="KEY_PRINCIPALS_INVALID")
    if (fixed or require_token) and parsed != {Scope.SEARCH}:
        raise BadInput(
            "--principals and --require-principal-token are for keys whose only scope is search",
            code="KEY_PRINCIPALS_INVALID",
        )
    if fixed and require_token:
        raise BadInput(
            "a key is bound to fixed --principals or requires a principal token, not both",
            code="KEY_PRINCIPALS_INVALID",
        )
    if len(fixed) > 1000 or any(len(p) > 200 or "\x00" in p for p in fixed):
        raise BadInput(
            "at most 1000 principals of at most 200 characters each",
            code="KEY_PRINCIPALS_INVALID",
        )
    source = (
        PrincipalSource.FIXED
        if fixed
        else PrincipalSource.TOKEN
        if require_token
        else PrincipalSource.CALLER
    )
    return KeySpec(parsed, source, fixed or None, name)


def _print_key(key_id: uuid.UUID, key: str) -> None:
    typer.echo(f"KB_API_KEY_ID={key_id}")
    typer.echo(f"KB_API_KEY={key}")


@keys_app.command("create")
def create_key(
    tenant: str = TENANT_ARG,
    scope: Annotated[
        list[str] | None,
        typer.Option("--scope", help="publish, search or admin (repeat, or separate with commas)."),
    ] = None,
    principals: Annotated[
        list[str] | None,
        typer.Option(
            "--principals",
            help="Bind a search key to these principals (repeat, or separate with commas): "
            "its searches use them, whatever the request says.",
        ),
    ] = None,
    require_principal_token: bool = typer.Option(
        False,
        "--require-principal-token",
        help="A search key whose searches must carry a verified principal token.",
    ),
    name: str | None = typer.Option(None, "--name", help="A label shown by `list`."),
) -> None:
    """Create a key; print KB_API_KEY_ID=<id> and KB_API_KEY=<key> (only its hash is stored)."""
    from services.publisher.keys.store_pg import PgKeyStore
    from services.runtime.logging import get_logger
    from services.runtime.tenancy.tenant_auth import hash_api_key, new_api_key

    check_tenant(tenant)
    spec = key_spec(scope or [], principals or [], require_principal_token, name)
    key = new_api_key(tenant)
    key_id = run_with_connection(
        lambda conn: PgKeyStore(conn).create_key(tenant, hash_api_key(key), spec)
    )
    get_logger(__name__).info(
        "key.created",
        tenant_id=tenant,
        key_id=str(key_id),
        scopes=sorted(s.value for s in spec.scopes),
        principal_source=spec.principal_source.value,
    )
    _print_key(key_id, key)


@keys_app.command("list")
def list_keys(
    tenant: str = TENANT_ARG,
    as_json: bool = typer.Option(False, "--json", help="One JSON array on stdout."),
) -> None:
    """The tenant's keys: id, name, scopes, where searches take principals from, state."""
    from services.publisher.keys.store_pg import PgKeyStore

    check_tenant(tenant)
    keys = run_with_connection(lambda conn: PgKeyStore(conn).list_keys(tenant))
    if as_json:
        typer.echo(
            json.dumps(
                [
                    {
                        "keyId": str(k.key_id),
                        "name": k.name,
                        "scopes": list(k.scopes),
                        "principalSource": k.principal_source,
                        "principals": list(k.principals) if k.principals is not None else None,
                        "createdAt": k.created_at.isoformat(),
                        "revokedAt": k.revoked_at.isoformat() if k.revoked_at else None,
                        "replacedBy": str(k.replaced_by) if k.replaced_by else None,
                        "active": k.active,
                    }
                    for k in keys
                ]
            )
        )
        return
    for k in keys:
        if k.principal_source == "fixed" and k.principals is not None:
            principals = "fixed:" + ",".join(k.principals[:5])
            principals += f",...(+{len(k.principals) - 5})" if len(k.principals) > 5 else ""
        else:
            principals = k.principal_source
        state = "active" if k.active else "revoked"
        if k.revoked_at is not None:
            state += (
                f" {'until' if k.active else 'at'} {k.revoked_at.isoformat(timespec='seconds')}"
            )
        typer.echo(
            "\t".join(
                [
                    str(k.key_id),
                    k.name or "-",
                    ",".join(k.scopes),
                    principals,
                    k.created_at.isoformat(timespec="seconds"),
                    state,
                ]
            )
        )


@keys_app.command("revoke")
def revoke_key(
    tenant: str = TENANT_ARG,
    key_id: str = typer.Argument(help="The key's id (KB_API_KEY_ID, or `list`)."),
) -> None:
    """Revoke a key: it fails from the next request on."""
    from services.publisher.keys.store_pg import PgKeyStore
    from services.runtime.logging import get_logger

    check_tenant(tenant)
    wanted = _key_id(key_id)
    # No time is passed: the database's clock decides, as it does for the API's key checks.
    changed = run_with_connection(lambda conn: PgKeyStore(conn).revoke_key(tenant, wanted))
    get_logger(__name__).info(
        "key.revoked" if changed else "key.already_revoked", tenant_id=tenant, key_id=key_id
    )


@keys_app.command("rotate")
def rotate_key(
    tenant: str = TENANT_ARG,
    key_id: str = typer.Argument(help="The id of the key to replace."),
    grace_seconds: int = typer.Option(
        0,
        "--grace-seconds",
        min=0,
        max=MAX_GRACE_SECONDS,
        help="How long the old key keeps working (0: it fails from the next request on).",
    ),
) -> None:
    """Create a key with the old one's scopes and principals and revoke the old one (after
    --grace-seconds); print the new KB_API_KEY_ID and KB_API_KEY."""
    from services.publisher.keys.store_pg import PgKeyStore
    from services.runtime.logging import get_logger
    from services.runtime.tenancy.tenant_auth import hash_api_key, new_api_key

    check_tenant(tenant)
    old = _key_id(key_id)
    key = new_api_key(tenant)
    new_id = run_with_connection(
        lambda conn: PgKeyStore(conn).rotate_key(
            tenant, old, hash_api_key(key), grace_seconds=grace_seconds
        )
    )
    get_logger(__name__).info(
        "key.rotated",
        tenant_id=tenant,
        key_id=str(old),
        new_key_id=str(new_id),
        grace_seconds=grace_seconds,
    )
    _print_key(new_id, key)
