"""Tenant API keys: ``kb.<tenant>.<secret>``; only the key's SHA-256 is stored.

The tenant inside the key lets every key lookup carry the tenant id in its WHERE clause
(``tenant_id = $1 AND key_hash = $2``), like every other query, and lets a key presented on
another tenant's path be told apart (403) from a key that is simply wrong (401).
"""

from __future__ import annotations

import hashlib
import re
import secrets
from dataclasses import dataclass

KEY_PREFIX = "kb"
TENANT_ID_PATTERN = r"^[a-z0-9][a-z0-9-]{0,62}$"
TIER_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,31}$"
_KEY = re.compile(r"^kb\.(?P<tenant>[a-z0-9][a-z0-9-]{0,62})\.(?P<secret>[A-Za-z0-9_-]{32,128})$")


@dataclass(frozen=True)
class PresentedKey:
    tenant_id: str
    key_hash: bytes


def new_api_key(tenant_id: str) -> str:
    return f"{KEY_PREFIX}.{tenant_id}.{secrets.token_urlsafe(32)}"


def hash_api_key(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def parse_api_key(key: str) -> PresentedKey | None:
    """The tenant a well-formed key claims to belong to and its hash; ``None`` if malformed."""
    match = _KEY.fullmatch(key)
    if match is None:
        return None
    return PresentedKey(tenant_id=match["tenant"], key_hash=hash_api_key(key))


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()
