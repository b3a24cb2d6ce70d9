"""`kb tenants keys create|list|revoke|rotate` and `kb tenants verification-keys
add|list|remove` (docs/security.md).

A new key is printed once, as ``KB_API_KEY_ID=<id>`` and ``KB_API_KEY=<key>`` (eval-able);
only its SHA-256 is stored. Secrets are never taken on the command line (where `ps` and
shell history would show them): an HMAC secret is read from a file or stdin. Drivers are
imported inside the commands, so `kb --help` does not pay for them.
"""

from __future__ import annotations

import json
import re
import sys
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Annotated, Any, Final

import typer

from services.runtime.errors import BadInput

MAX_GRACE_SECONDS: Final = 30 * 86_400
MAX_KEY_FILE_BYTES: Final = 16 * 1024

keys_app = typer.Typer(
    help="A tenant's API keys: scopes, principals, revocation, rotation.", no_args_is_help=True
)
verification_keys_app = typer.Typer(
    help="The keys a tenant's principal tokens are verified with.", no_args_is_help=True
)

TenantArg = typer.Argument(help="The tenant id.")


def _check_tenant(tenant: str) -> None:
    from services.runtime.tenant_ids import TENANT_ID_PATTERN

    if not re.fullmatch(TENANT_ID_PATTERN, tenant):
        raise BadInput(f"tenant name {tenant!r} is invalid", code="TENANT_NAME_INVALID")


def _key_id(value: str) -> uuid.UUID:
    try:
        return uuid.UUID(value)
    except ValueError:
        raise BadInput(f"{value!r} is not a key id (a UUID)", code="KEY_ID_INVALID") from None


def _run(work: Any) -> Any:
    """Run ``work(conn)`` on one connection of the configured database."""
    from services.publisher.settings import PublisherSettings
    from services.runtime.cli_support import load_settings, run_async
    from services.runtime.db import connection
    from services.runtime.logging import configure_logging

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
    from services.runtime.principals import normalise_principals

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
    tenant: str = TenantArg,
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
    from services.runtime.tenant_auth import hash_api_key, new_api_key

    _check_tenant(tenant)
    spec = key_spec(scope or [], principals or [], require_principal_token, name)
    key = new_api_key(tenant)
    key_id = _run(lambda conn: PgKeyStore(conn).create_key(tenant, hash_api_key(key), spec))
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
    tenant: str = TenantArg,
    as_json: bool = typer.Option(False, "--json", help="One JSON array on stdout."),
) -> None:
    """The tenant's keys: id, name, scopes, where searches take principals from, state."""
    from services.publisher.keys.store_pg import PgKeyStore

    _check_tenant(tenant)
    keys = _run(lambda conn: PgKeyStore(conn).list_keys(tenant))
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
    tenant: str = TenantArg,
    key_id: str = typer.Argument(help="The key's id (KB_API_KEY_ID, or `list`)."),
) -> None:
    """Revoke a key: it fails from the next request on."""
    from services.publisher.keys.store_pg import PgKeyStore
    from services.runtime.logging import get_logger

    _check_tenant(tenant)
    wanted = _key_id(key_id)
    now = datetime.now(UTC)
    changed = _run(lambda conn: PgKeyStore(conn).revoke_key(tenant, wanted, now))
    get_logger(__name__).info(
        "key.revoked" if changed else "key.already_revoked", tenant_id=tenant, key_id=key_id
    )


@keys_app.command("rotate")
def rotate_key(
    tenant: str = TenantArg,
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
    from services.runtime.tenant_auth import hash_api_key, new_api_key

    _check_tenant(tenant)
    old = _key_id(key_id)
    key = new_api_key(tenant)
    until = datetime.now(UTC) + timedelta(seconds=grace_seconds)
    new_id = _run(
        lambda conn: PgKeyStore(conn).rotate_key(
            tenant, old, hash_api_key(key), old_key_until=until
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


def _read_key_file(path: str) -> bytes:
    if path == "-":
        data = sys.stdin.buffer.read(MAX_KEY_FILE_BYTES + 1)
    else:
        try:
            with Path(path).open("rb") as file:
                data = file.read(MAX_KEY_FILE_BYTES + 1)
        except OSError as error:
            raise BadInput(
                f"cannot read {path}: {error.strerror}", code="VERIFICATION_KEY_INVALID"
            ) from None
    if len(data) > MAX_KEY_FILE_BYTES:
        raise BadInput("the key file is too large", code="VERIFICATION_KEY_INVALID")
    return data


@verification_keys_app.command("add")
def add_verification_key(
    tenant: str = TenantArg,
    kid: str = typer.Option(..., "--kid", help="The id tokens name in their header's kid."),
    public_key_file: str | None = typer.Option(
        None, "--public-key-file", help="An Ed25519 or RSA public key, PEM ('-': stdin)."
    ),
    hmac_secret_file: str | None = typer.Option(
        None,
        "--hmac-secret-file",
        help="A file holding an HMAC secret of at least 32 bytes ('-': stdin). It is stored "
        "as it is: prefer a public key.",
    ),
    algorithm: str | None = typer.Option(
        None,
        "--algorithm",
        help="The one JWT alg accepted: EdDSA, RS256..RS512, PS256..PS512, HS256..HS512 "
        "(default: EdDSA, RS256 or HS256 by the key's kind).",
    ),
    audience: str | None = typer.Option(
        None, "--audience", help="The aud tokens must carry (default kb:<tenant>)."
    ),
    issuer: str | None = typer.Option(None, "--issuer", help="The iss tokens must carry."),
) -> None:
    """Register a key to verify the tenant's principal tokens with."""
    from services.publisher.keys.store_pg import PgKeyStore
    from services.runtime.auth.tokens import (
        HMAC_ALGORITHMS,
        KID_PATTERN,
        checked_key_material,
        default_algorithm,
    )
    from services.runtime.logging import get_logger

    _check_tenant(tenant)
    if not re.fullmatch(KID_PATTERN, kid):
        raise BadInput(
            "a kid has 1 to 64 letters, digits, '.', '_', ':' or '-'",
            code="VERIFICATION_KEY_INVALID",
        )
    if (public_key_file is None) == (hmac_secret_file is None):
        raise BadInput(
            "name exactly one of --public-key-file and --hmac-secret-file",
            code="VERIFICATION_KEY_INVALID",
        )
    hmac = hmac_secret_file is not None
    material = _read_key_file(
        hmac_secret_file if hmac_secret_file is not None else str(public_key_file)
    )
    chosen = algorithm or default_algorithm(material, hmac=hmac)
    if hmac != (chosen in HMAC_ALGORITHMS):
        raise BadInput(
            f"{chosen} does not go with {'an HMAC secret' if hmac else 'a public key'}",
            code="VERIFICATION_KEY_INVALID",
        )
    for label, value in (("--audience", audience), ("--issuer", issuer)):
        if value is not None and not 1 <= len(value) <= 200:
            raise BadInput(f"{label} has 1 to 200 characters", code="VERIFICATION_KEY_INVALID")
    stored = checked_key_material(chosen, material)
    _run(
        lambda conn: PgKeyStore(conn).add_verification_key(
            tenant, kid, chosen, stored, audience=audience, issuer=issuer
        )
    )
    get_logger(__name__).info("verification_key.added", tenant_id=tenant, kid=kid, algorithm=chosen)


@verification_keys_app.command("list")
def list_verification_keys(
    tenant: str = TenantArg,
    as_json: bool = typer.Option(False, "--json", help="One JSON array on stdout."),
) -> None:
    """The tenant's verification keys (never their material)."""
    from services.publisher.keys.store_pg import PgKeyStore
    from services.runtime.auth.tokens import default_audience

    _check_tenant(tenant)
    keys = _run(lambda conn: PgKeyStore(conn).list_verification_keys(tenant))
    rows = [
        {
            "kid": k.kid,
            "algorithm": k.algorithm,
            "audience": k.audience or default_audience(tenant),
            "issuer": k.issuer,
            "createdAt": k.created_at.isoformat(timespec="seconds"),
        }
        for k in keys
    ]
    if as_json:
        typer.echo(json.dumps(rows))
        return
    for row in rows:
        typer.echo(
            "\t".join(
                str(row[c] or "-") for c in ("kid", "algorithm", "audience", "issuer", "createdAt")
            )
        )


@verification_keys_app.command("remove")
def remove_verification_key(
    tenant: str = TenantArg,
    kid: str = typer.Argument(help="The kid to remove: its tokens fail from the next search on."),
) -> None:
    """Remove a verification key."""
    from services.publisher.keys.store_pg import PgKeyStore
    from services.runtime.logging import get_logger

    _check_tenant(tenant)
    _run(lambda conn: PgKeyStore(conn).remove_verification_key(tenant, kid))
    get_logger(__name__).info("verification_key.removed", tenant_id=tenant, kid=kid)
