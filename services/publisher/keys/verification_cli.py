"""`kb tenants verification-keys add|list|remove`: the keys a tenant's principal tokens are
verified with (docs/security.md#principal-tokens). A secret is read from a file or stdin,
never the command line; a listing never shows key material."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Final

import typer

from services.publisher.keys.cli import TENANT_ARG, check_tenant, run_with_connection
from services.runtime.errors import BadInput

MAX_KEY_FILE_BYTES: Final = 16 * 1024

verification_keys_app = typer.Typer(
    help="The keys a tenant's principal tokens are verified with.", no_args_is_help=True
)


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
    tenant: str = TENANT_ARG,
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

    check_tenant(tenant)
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
    run_with_connection(
        lambda conn: PgKeyStore(conn).add_verification_key(
            tenant, kid, chosen, stored, audience=audience, issuer=issuer
        )
    )
    get_logger(__name__).info("verification_key.added", tenant_id=tenant, kid=kid, algorithm=chosen)


@verification_keys_app.command("list")
def list_verification_keys(
    tenant: str = TENANT_ARG,
    as_json: bool = typer.Option(False, "--json", help="One JSON array on stdout."),
) -> None:
    """The tenant's verification keys (never their material)."""
    from services.publisher.keys.store_pg import PgKeyStore
    from services.runtime.auth.tokens import default_audience

    check_tenant(tenant)
    keys = run_with_connection(lambda conn: PgKeyStore(conn).list_verification_keys(tenant))
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
    tenant: str = TENANT_ARG,
    kid: str = typer.Argument(help="The kid to remove: its tokens fail from the next search on."),
) -> None:
    """Remove a verification key."""
    from services.publisher.keys.store_pg import PgKeyStore
    from services.runtime.logging import get_logger

    check_tenant(tenant)
    run_with_connection(lambda conn: PgKeyStore(conn).remove_verification_key(tenant, kid))
    get_logger(__name__).info("verification_key.removed", tenant_id=tenant, kid=kid)
