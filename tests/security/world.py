"""One composed app over one database for a whole security module: two tenants with a key
of every kind, an operator key, verification keys of every kind, and documents whose ACLs
the tests try to get around. Built once per module (tests/security/conftest.py): each test
only sends requests, so they share it."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import asyncpg
import httpx
import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519, rsa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.rsa import RSAPrivateKey
from fastapi import FastAPI

from services.app import create_app
from services.embedding.hashing import HashingEmbedder
from services.operator.auth import digest, new_operator_key
from services.operator.context import build_operator_context
from services.publisher.bulk.store_pg import PgBulkStore
from services.publisher.ingest.store_pg import PgIngestStore
from services.publisher.keys.store_pg import KeySpec, PgKeyStore
from services.publisher.settings import PublisherSettings
from services.publisher.store_pg import PgTenantStore
from services.publisher.web.api import PublisherStores
from services.runtime.auth.keys import PrincipalSource, Scope
from services.runtime.auth.settings import AuthSettings
from services.runtime.auth.tokens import checked_key_material
from services.runtime.erasure.erase_pg import PgErasureStore
from services.runtime.tenancy.tenant_auth import hash_api_key, new_api_key
from services.search.connections import open_search_pool
from services.search.index_pg import PgSearchIndex
from services.search.searcher import Generation, Searcher
from services.search.statements import SearchSettings
from tests.support.api import BASE_URL
from tests.support.operator import operator_settings
from tests.support.search import ChunkSpec, add_document, add_version, point_search_at

DIMENSION = 32
# Every indexed text starts with this word, so one query finds every chunk a principal may
# read: whatever a search answers beyond what its principals may read is a leak.
QUERY = "handbook"


@dataclass(frozen=True)
class Caller:
    """A tenant path and the Authorization header a test sends (None: no header)."""

    tenant_id: str
    authorization: str | None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": self.authorization} if self.authorization else {}

    def path(self, rest: str = "") -> str:
        return f"/v1/tenants/{self.tenant_id}{rest}"


def bearer(key: str) -> str:
    return f"Bearer {key}"


@dataclass(frozen=True)
class SecretDocument:
    document_id: uuid.UUID
    title: str
    text: str
    read: tuple[str, ...]


@dataclass
class Tenant:
    tenant_id: str
    keys: dict[str, tuple[uuid.UUID, str]] = field(default_factory=dict)
    documents: list[SecretDocument] = field(default_factory=list)

    def caller(self, kind: str) -> Caller:
        return Caller(self.tenant_id, bearer(self.keys[kind][1]))

    def readable_by(self, principals: Sequence[str]) -> set[uuid.UUID]:
        wanted = set(principals)
        return {d.document_id for d in self.documents if wanted.intersection(d.read)}


@dataclass
class SigningKeys:
    ed25519: Ed25519PrivateKey
    rsa: RSAPrivateKey
    hmac_secret: str
    stranger_ed25519: Ed25519PrivateKey

    def rsa_public_pem(self) -> bytes:
        return self.rsa.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )


@dataclass
class World:
    app: FastAPI
    client: httpx.AsyncClient
    pool: asyncpg.Pool[Any]
    acme: Tenant
    globex: Tenant
    operator_key: str
    signing: SigningKeys
    secrets: list[str]

    def token(
        self,
        principals: Sequence[str] | None,
        *,
        tenant_id: str = "acme",
        kid: str = "ed",
        key: Any = None,
        algorithm: str = "EdDSA",
        lifetime: int = 300,
        issued_at: float | None = None,
        extra: dict[str, Any] | None = None,
        drop: Sequence[str] = (),
    ) -> str:
        now = time.time() if issued_at is None else issued_at
        claims: dict[str, Any] = {
            "sub": "user:alice",
            "aud": f"kb:{tenant_id}",
            "iat": int(now),
            "exp": int(now) + lifetime,
        }
        if principals is not None:
            claims["principals"] = list(principals)
        claims.update(extra or {})
        for name in drop:
            claims.pop(name, None)
        signing_key = key if key is not None else self.signing.ed25519
        return jwt.encode(claims, signing_key, algorithm=algorithm, headers={"kid": kid})

    async def search(self, caller: Caller, body: dict[str, Any], **kwargs: Any) -> httpx.Response:
        return await self.client.post(
            caller.path("/search"), json={"query": QUERY, **body}, headers=caller.headers, **kwargs
        )


def _pem(public_key: Any) -> bytes:
    data: bytes = public_key.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return data


async def _key(
    store: PgKeyStore, tenant: Tenant, kind: str, spec: KeySpec, *, revoke: bool = False
) -> None:
    key = new_api_key(tenant.tenant_id)
    key_id = await store.create_key(tenant.tenant_id, hash_api_key(key), spec)
    if revoke:
        await store.revoke_key(tenant.tenant_id, key_id, datetime.now(UTC))
    tenant.keys[kind] = (key_id, key)


async def _documents(
    conn: asyncpg.Connection[Any], tenant: Tenant, embedder: HashingEmbedder
) -> None:
    acls: list[tuple[str, ...]] = [
        ("group:support",),
        ("group:hr",),
        ("user:alice",),
        ("group:Support",),  # a case variant: a principal of its own
        ("*",),  # a wildcard-looking principal: matches only the principal "*"
        ("%",),
    ]
    for number, read in enumerate(acls):
        secret = f"secret-{tenant.tenant_id}-{number}-{uuid.uuid4().hex[:8]}"
        title = f"Title {secret}"
        text = f"{QUERY} {secret} confidential"
        document_id = await add_document(conn, tenant.tenant_id, title=title, read=read)
        await add_version(conn, tenant.tenant_id, document_id, 1, [ChunkSpec(text)], embedder)
        await point_search_at(conn, tenant.tenant_id, document_id, 1, embedder.model)
        tenant.documents.append(SecretDocument(document_id, title, text, read))


async def world_data_in(database_url: str) -> tuple[Tenant, Tenant, str, SigningKeys]:
    """build_world_data on a connection of its own to ``database_url``."""
    conn = await asyncpg.connect(database_url)
    try:
        return await build_world_data(conn)
    finally:
        await conn.close()


async def build_world_data(
    conn: asyncpg.Connection[Any],
) -> tuple[Tenant, Tenant, str, SigningKeys]:
    embedder = HashingEmbedder(DIMENSION)
    signing = SigningKeys(
        ed25519=ed25519.Ed25519PrivateKey.generate(),
        rsa=rsa.generate_private_key(public_exponent=65537, key_size=2048),
        hmac_secret="h" * 16 + uuid.uuid4().hex,
        stranger_ed25519=ed25519.Ed25519PrivateKey.generate(),
    )
    store = PgKeyStore(conn)
    tenants = []
    for tenant_id in ("acme", "globex"):
        tenant = Tenant(tenant_id)
        admin = new_api_key(tenant_id)
        await PgTenantStore(conn).create_tenant(tenant_id, "standard", hash_api_key(admin))
        tenant.keys["admin"] = (uuid.uuid4(), admin)
        await _key(store, tenant, "publish", KeySpec(frozenset({Scope.PUBLISH})))
        await _key(store, tenant, "search", KeySpec(frozenset({Scope.SEARCH})))
        await _key(
            store,
            tenant,
            "bound",
            KeySpec(frozenset({Scope.SEARCH}), PrincipalSource.FIXED, ("group:support",)),
        )
        await _key(
            store, tenant, "token_only", KeySpec(frozenset({Scope.SEARCH}), PrincipalSource.TOKEN)
        )
        await _key(store, tenant, "revoked", KeySpec(frozenset({Scope.ADMIN})), revoke=True)
        await _documents(conn, tenant, embedder)
        tenants.append(tenant)
    acme, globex = tenants
    for kid, algorithm, material in (
        ("ed", "EdDSA", _pem(signing.ed25519.public_key())),
        ("rsa", "RS256", signing.rsa_public_pem()),
        ("hmac", "HS256", signing.hmac_secret.encode()),
    ):
        await store.add_verification_key(
            "acme",
            kid,
            algorithm,
            checked_key_material(algorithm, material),
            audience=None,
            issuer=None,
        )
    # globex verifies with a key of its own under the same kid, and shares acme's RSA key
    # (one identity provider for both): audiences keep their tokens apart.
    await store.add_verification_key(
        "globex",
        "ed",
        "EdDSA",
        checked_key_material("EdDSA", _pem(signing.stranger_ed25519.public_key())),
        audience=None,
        issuer=None,
    )
    await store.add_verification_key(
        "globex",
        "rsa",
        "RS256",
        checked_key_material("RS256", signing.rsa_public_pem()),
        audience=None,
        issuer=None,
    )
    operator_key = new_operator_key()
    await conn.execute(
        "INSERT INTO operator_key (operator_id, name, key_hash) VALUES ($1, 'sec', $2)",
        uuid.uuid4(),
        digest(operator_key),
    )
    return acme, globex, operator_key, signing


@asynccontextmanager
async def world_app(
    database_url: str, auth_settings: AuthSettings
) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient, asyncpg.Pool[Any]]]:
    """The composed app (publisher, search, operator page) over ``database_url``."""
    publisher_settings = PublisherSettings(database_url=database_url, db_pool_max_size=4)
    pool = await open_search_pool(publisher_settings)
    try:
        embedder = HashingEmbedder(DIMENSION)
        index = PgSearchIndex(
            pool,
            Generation(embedder.model, DIMENSION),
            SearchSettings(database_url=database_url, search_exact_max_chunks=10_000_000),
        )
        app = create_app(
            publisher_settings,
            stores=PublisherStores(
                PgIngestStore(pool), bulk=PgBulkStore(pool), erasure=PgErasureStore(pool)
            ),
            searcher=Searcher(embedder, index),
            # The client below speaks plain HTTP: a Secure cookie would never come back.
            operator=build_operator_context(
                pool, operator_settings(database_url, operator_secure_cookie=False)
            ),
            auth_settings=auth_settings,
        )
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url=BASE_URL) as client:
            yield app, client, pool
    finally:
        await pool.close()
