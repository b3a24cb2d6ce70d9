"""What a tenant API key may do, and the keys a tenant's principal tokens are verified with
(docs/security.md).

A key has scopes (``publish``, ``search``, ``admin``; admin includes the other two) and a
principal source saying where a search with it takes its principals from: the request
(``caller``), the key itself (``fixed``) or a verified principal token (``token``). Keys made
before scopes existed are admin keys with the ``caller`` source: they work as they always
did. Only the SHA-256 of a key is stored.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any, Final, Protocol

from services.runtime.pg.db import translate_db_errors
from services.runtime.pg.sql import queries_beside

QUERIES = queries_beside(__file__, "keys.sql")


class Scope(StrEnum):
    PUBLISH = "publish"
    SEARCH = "search"
    ADMIN = "admin"


class PrincipalSource(StrEnum):
    CALLER = "caller"
    FIXED = "fixed"
    TOKEN = "token"


ALL_SCOPES: Final = frozenset(Scope)


@dataclass(frozen=True)
class ApiKeyGrant:
    """What a valid key may do (never the key or its hash)."""

    key_id: uuid.UUID
    scopes: frozenset[Scope]
    principal_source: PrincipalSource = PrincipalSource.CALLER
    principals: tuple[str, ...] | None = None

    def allows(self, scope: Scope) -> bool:
        return Scope.ADMIN in self.scopes or scope in self.scopes


def admin_grant(key_id: uuid.UUID | None = None) -> ApiKeyGrant:
    """The grant of a key made by `kb tenants create` (and of every key older than scopes)."""
    return ApiKeyGrant(key_id or uuid.uuid4(), frozenset({Scope.ADMIN}))


def grant_from_row(row: Any) -> ApiKeyGrant:
    principals = row["principals"]
    return ApiKeyGrant(
        key_id=row["key_id"],
        scopes=frozenset(Scope(s) for s in row["scopes"]),
        principal_source=PrincipalSource(row["principal_source"]),
        principals=tuple(principals) if principals is not None else None,
    )


@dataclass(frozen=True)
class VerificationKey:
    """A key a tenant registered to verify its principal tokens with. ``key_material`` is a
    PEM public key, or an HMAC secret (never printed, never logged)."""

    kid: str
    algorithm: str
    key_material: str
    audience: str | None = None
    issuer: str | None = None

    def __repr__(self) -> str:  # the HMAC secret must not end up in a log or a traceback
        return f"VerificationKey(kid={self.kid!r}, algorithm={self.algorithm!r})"


class TenantCredentials(Protocol):
    """The reads tenant authentication needs (the publisher's store, or a fake)."""

    async def api_key(
        self, tenant_id: str, key_hash: bytes, now: datetime | None = None
    ) -> ApiKeyGrant | None: ...

    async def verification_key(self, tenant_id: str, kid: str) -> VerificationKey | None: ...


class PgTenantCredentials:
    """:class:`TenantCredentials` over PostgreSQL; ``connection`` is a pool's ``acquire``
    (an async context manager of a connection)."""

    def __init__(self, connection: Callable[[], Any]) -> None:
        self._connection = connection

    async def api_key(
        self, tenant_id: str, key_hash: bytes, now: datetime | None = None
    ) -> ApiKeyGrant | None:
        with translate_db_errors():
            async with self._connection() as conn:
                row = await conn.fetchrow(QUERIES["find_api_key"], tenant_id, key_hash, now)
        return grant_from_row(row) if row is not None else None

    async def verification_key(self, tenant_id: str, kid: str) -> VerificationKey | None:
        with translate_db_errors():
            async with self._connection() as conn:
                row = await conn.fetchrow(QUERIES["find_verification_key"], tenant_id, kid)
        if row is None:
            return None
        return VerificationKey(
            kid=row["kid"],
            algorithm=row["algorithm"],
            key_material=row["key_material"],
            audience=row["audience"],
            issuer=row["issuer"],
        )


def parse_scopes(values: Iterable[str]) -> frozenset[Scope]:
    """Scopes named on a command line (``ValueError`` naming an unknown one)."""
    scopes: set[Scope] = set()
    for value in values:
        for item in value.split(","):
            name = item.strip().lower()
            if not name:
                continue
            try:
                scopes.add(Scope(name))
            except ValueError:
                known = ", ".join(s.value for s in Scope)
                raise ValueError(f"unknown scope {name!r}: use {known}") from None
    return frozenset(scopes)
