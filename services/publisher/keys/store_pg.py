"""The storage of `kb tenants keys` and `kb tenants verification-keys`: one method per named
query in ``keys.sql``. Only a key's SHA-256 ever reaches the database."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg

from services.runtime.auth.keys import PrincipalSource, Scope
from services.runtime.errors import BadInput, NotFound
from services.runtime.pg.db import translate_db_errors
from services.runtime.pg.records import from_row
from services.runtime.pg.sql import queries_beside

QUERIES = queries_beside(__file__, "keys.sql")


@dataclass(frozen=True)
class KeySpec:
    """What a new key may do."""

    scopes: frozenset[Scope]
    principal_source: PrincipalSource = PrincipalSource.CALLER
    principals: tuple[str, ...] | None = None
    name: str | None = None


@dataclass(frozen=True)
class KeyListing:
    key_id: uuid.UUID
    name: str | None
    scopes: tuple[str, ...]
    principal_source: str
    principals: tuple[str, ...] | None
    created_at: datetime
    revoked_at: datetime | None
    replaced_by: uuid.UUID | None
    active: bool


@dataclass(frozen=True)
class VerificationKeyListing:
    kid: str
    algorithm: str
    audience: str | None
    issuer: str | None
    created_at: datetime


def _scope_list(scopes: frozenset[Scope]) -> list[str]:
    order = list(Scope)
    return [s.value for s in sorted(scopes, key=order.index)]


class PgKeyStore:
    def __init__(self, conn: asyncpg.Connection[Any]) -> None:
        self._conn = conn

    async def _require_tenant(self, tenant_id: str) -> None:
        if not await self._conn.fetchval(QUERIES["tenant_exists"], tenant_id):
            raise NotFound(f"no tenant {tenant_id!r}", code="TENANT_NOT_FOUND")

    async def create_key(self, tenant_id: str, key_hash: bytes, spec: KeySpec) -> uuid.UUID:
        key_id = uuid.uuid4()
        with translate_db_errors():
            async with self._conn.transaction():
                await self._require_tenant(tenant_id)
                await self._insert(tenant_id, key_id, key_hash, spec)
        return key_id

    async def _insert(
        self, tenant_id: str, key_id: uuid.UUID, key_hash: bytes, spec: KeySpec
    ) -> None:
        await self._conn.execute(
            QUERIES["insert_key"],
            key_id,
            tenant_id,
            key_hash,
            spec.name,
            _scope_list(spec.scopes),
            spec.principal_source.value,
            list(spec.principals) if spec.principals is not None else None,
        )

    async def list_keys(self, tenant_id: str, now: datetime | None = None) -> list[KeyListing]:
        with translate_db_errors():
            await self._require_tenant(tenant_id)
            rows = await self._conn.fetch(QUERIES["list_keys"], tenant_id, now)
        return [
            KeyListing(
                key_id=row["key_id"],
                name=row["name"],
                scopes=tuple(row["scopes"]),
                principal_source=row["principal_source"],
                principals=tuple(row["principals"]) if row["principals"] is not None else None,
                created_at=row["created_at"],
                revoked_at=row["revoked_at"],
                replaced_by=row["replaced_by"],
                active=row["active"],
            )
            for row in rows
        ]

    async def revoke_key(
        self, tenant_id: str, key_id: uuid.UUID, at: datetime | None = None
    ) -> bool:
        """Revoke from ``at`` on (``None``: the database's now); ``False`` when the key was
        already revoked by then (:class:`NotFound` when the tenant has no such key)."""
        with translate_db_errors():
            async with self._conn.transaction():
                revoked = await self._conn.fetchval(QUERIES["revoke_key"], tenant_id, key_id, at)
                if revoked is None and (
                    await self._conn.fetchval(QUERIES["key_state"], tenant_id, key_id, at) is None
                ):
                    raise NotFound(
                        f"tenant {tenant_id!r} has no key {key_id}", code="KEY_NOT_FOUND"
                    )
        return revoked is not None

    async def rotate_key(
        self,
        tenant_id: str,
        key_id: uuid.UUID,
        new_key_hash: bytes,
        *,
        grace_seconds: float = 0.0,
        old_key_until: datetime | None = None,
        now: datetime | None = None,
    ) -> uuid.UUID:
        """A new key with the old one's scopes and principals; the old one works for
        ``grace_seconds`` more from ``now`` (``None``: the database's now), or until
        ``old_key_until`` when given. One transaction: both happen, or neither."""
        new_id = uuid.uuid4()
        with translate_db_errors():
            async with self._conn.transaction():
                row = await self._conn.fetchrow(QUERIES["lock_active_key"], tenant_id, key_id, now)
                if row is None:
                    raise NotFound(
                        f"tenant {tenant_id!r} has no active key {key_id} that was not "
                        "already rotated",
                        code="KEY_NOT_FOUND",
                    )
                principals = row["principals"]
                spec = KeySpec(
                    scopes=frozenset(Scope(s) for s in row["scopes"]),
                    principal_source=PrincipalSource(row["principal_source"]),
                    principals=tuple(principals) if principals is not None else None,
                    name=row["name"],
                )
                await self._insert(tenant_id, new_id, new_key_hash, spec)
                await self._conn.execute(
                    QUERIES["mark_replaced"],
                    tenant_id,
                    key_id,
                    new_id,
                    old_key_until or now,
                    0.0 if old_key_until is not None else float(grace_seconds),
                )
        return new_id

    async def add_verification_key(
        self,
        tenant_id: str,
        kid: str,
        algorithm: str,
        key_material: str,
        *,
        audience: str | None,
        issuer: str | None,
    ) -> None:
        with translate_db_errors():
            async with self._conn.transaction():
                await self._require_tenant(tenant_id)
                added = await self._conn.fetchval(
                    QUERIES["insert_verification_key"],
                    tenant_id,
                    kid,
                    algorithm,
                    key_material,
                    audience,
                    issuer,
                )
        if added is None:
            raise BadInput(
                f"tenant {tenant_id!r} already has a verification key {kid!r}: remove it "
                "first, or add the new one under another kid",
                code="VERIFICATION_KEY_EXISTS",
            )

    async def list_verification_keys(self, tenant_id: str) -> Sequence[VerificationKeyListing]:
        with translate_db_errors():
            await self._require_tenant(tenant_id)
            rows = await self._conn.fetch(QUERIES["list_verification_keys"], tenant_id)
        return [from_row(VerificationKeyListing, row) for row in rows]

    async def remove_verification_key(self, tenant_id: str, kid: str) -> None:
        with translate_db_errors():
            removed = await self._conn.fetchval(QUERIES["delete_verification_key"], tenant_id, kid)
        if removed is None:
            raise NotFound(
                f"tenant {tenant_id!r} has no verification key {kid!r}",
                code="VERIFICATION_KEY_NOT_FOUND",
            )
