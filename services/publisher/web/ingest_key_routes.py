"""A tenant's ingest keys over HTTP (docs/security.md#publish-by-event): an admin key
registers the Ed25519 public key its producers sign commands with, lists them and revokes
one. The same as `kb tenants ingest-keys add|list|revoke`, behind the tenant wall."""

from __future__ import annotations

import base64
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Request, Security
from pydantic import Field

from services.publisher.ingest.ports import IngestKeyRegistry
from services.publisher.ingest.signing import (
    KEY_ID_PATTERN,
    IngestKeyExists,
    IngestKeyNotFound,
    decode_public_key,
)
from services.runtime.auth.keys import Scope
from services.runtime.errors import KbError
from services.runtime.logging import get_logger
from services.runtime.tenancy.tenant_auth import require_scope
from services.runtime.tenancy.tenant_ids import TENANT_ID_PATTERN
from services.runtime.web.http_problem import PROBLEM_RESPONSE
from services.runtime.web.wire import ApiModel

log = get_logger(__name__)

TenantId = Annotated[str, Path(alias="tenantId", pattern=TENANT_ID_PATTERN)]
KeyId = Annotated[str, Path(alias="keyId", pattern=KEY_ID_PATTERN)]


class IngestKeysUnavailable(KbError, code="INGEST_KEYS_UNAVAILABLE"):
    """The app's store keeps no ingest keys (a wiring bug: 500)."""


class IngestKeyRequest(ApiModel):
    key_id: str = Field(pattern=KEY_ID_PATTERN, description="Named by the `kb-key-id` header.")
    public_key: str = Field(
        min_length=40,
        max_length=48,
        description="The Ed25519 public key: its 32 raw bytes in base64 (standard or URL-safe).",
    )


class IngestKeyResponse(ApiModel):
    key_id: str
    created_at: datetime | None = None
    revoked_at: datetime | None = None


class IngestKeyListed(ApiModel):
    key_id: str
    public_key: str = Field(description="The Ed25519 public key: its 32 raw bytes in base64.")
    created_at: datetime
    revoked_at: datetime | None = None


class IngestKeyList(ApiModel):
    # Revoked keys too, oldest first: the operator's record of what signed when.
    keys: list[IngestKeyListed]


def _admin(request: Request, tenant_id: TenantId) -> None:
    require_scope(request, tenant_id, Scope.ADMIN)


def _registry(request: Request) -> IngestKeyRegistry:
    store: Any = request.app.state.store
    if not hasattr(store, "add_ingest_key"):
        raise IngestKeysUnavailable("this publisher's store keeps no ingest keys")
    registry: IngestKeyRegistry = store
    return registry


def _problems(*statuses: int) -> dict[int | str, dict[str, Any]]:
    common = {400, 401, 403, 408, 413, 422, 429, 503}  # as every tenant route's
    return {s: PROBLEM_RESPONSE for s in sorted({*common, *statuses})}


def ingest_key_router(security: Any) -> APIRouter:
    """The routes behind the tenant routes' authentication (``security``: their bearer
    scheme), for admin keys only."""
    router = APIRouter(
        prefix="/v1/tenants/{tenantId}", dependencies=[Security(security), Depends(_admin)]
    )
    router.add_api_route(
        "/ingest-keys",
        add_ingest_key,
        methods=["POST"],
        status_code=201,
        response_model=IngestKeyResponse,
        responses=_problems(409),
        summary="Register a public key the tenant's producers sign ingest commands with",
    )
    router.add_api_route(
        "/ingest-keys",
        list_ingest_keys,
        methods=["GET"],
        response_model=IngestKeyList,
        responses=_problems(),
        summary="The tenant's ingest keys, revoked ones included, oldest first",
    )
    router.add_api_route(
        "/ingest-keys/{keyId}",
        revoke_ingest_key,
        methods=["DELETE"],
        response_model=IngestKeyResponse,
        responses=_problems(404),
        summary="Revoke an ingest key at once: commands signed with it are refused",
    )
    return router


async def add_ingest_key(
    request: Request, tenant_id: TenantId, body: IngestKeyRequest
) -> IngestKeyResponse:
    raw = decode_public_key(body.public_key)
    created = await _registry(request).add_ingest_key(tenant_id, body.key_id, raw)
    if created is None:
        raise IngestKeyExists(f"this tenant has a key {body.key_id!r} already")
    log.info("ingest_key.added", tenant_id=tenant_id, key_id=body.key_id)
    return IngestKeyResponse(key_id=body.key_id, created_at=created)


async def list_ingest_keys(request: Request, tenant_id: TenantId) -> IngestKeyList:
    rows = await _registry(request).list_ingest_keys(tenant_id)
    return IngestKeyList(
        keys=[
            IngestKeyListed(
                key_id=row["key_id"],
                public_key=base64.b64encode(bytes(row["public_key"])).decode(),
                created_at=row["created_at"],
                revoked_at=row["revoked_at"],
            )
            for row in rows
        ]
    )


async def revoke_ingest_key(
    request: Request, tenant_id: TenantId, key_id: KeyId
) -> IngestKeyResponse:
    revoked = await _registry(request).revoke_ingest_key(tenant_id, key_id)
    if revoked is None:
        raise IngestKeyNotFound(f"this tenant has no live key {key_id!r}")
    log.info("ingest_key.revoked", tenant_id=tenant_id, key_id=key_id)
    return IngestKeyResponse(key_id=key_id, revoked_at=revoked)
