"""Who may publish for a tenant (docs/security.md#publish-by-event): every command is signed
with an Ed25519 key the tenant registered (``kb tenants ingest-keys add``); the signature
covers the record's value, the encoded command bytes, tenant id included. A producer that
can write the topic but holds no key of the tenant a command names cannot make it apply.

The signature and the key's id travel as Kafka headers (``kb-signature``: the 64 bytes in
base64, text like every other header, readable with any tool; ``kb-key-id``), so the value
stays the plain single-object encoded command.
"""

from __future__ import annotations

import base64
import binascii
import functools
import re
from dataclasses import dataclass
from typing import Final

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from services.runtime.errors import BadInput, Conflict, Forbidden, NotFound

SIGNATURE_HEADER: Final = "kb-signature"
KEY_ID_HEADER: Final = "kb-key-id"
KEY_ID_PATTERN: Final = r"^[A-Za-z0-9._:-]{1,64}$"
PUBLIC_KEY_BYTES: Final = 32
SIGNATURE_BYTES: Final = 64


class SignatureInvalid(Forbidden, code="INGEST_SIGNATURE_INVALID"):
    """The command is unsigned, names a key its tenant does not have (or revoked), or its
    signature does not verify with that key."""


class IngestKeyInvalid(BadInput, code="INGEST_KEY_INVALID"):
    """A public key that cannot be registered: not 32 raw bytes of an Ed25519 key."""


class IngestKeyExists(Conflict, code="INGEST_KEY_EXISTS"):
    """The tenant has a key of that id already (revoked or not: ids are not reused)."""


class IngestKeyNotFound(NotFound, code="INGEST_KEY_NOT_FOUND"):
    """The tenant has no live key of that id."""


def decode_public_key(value: str) -> bytes:
    """A public key as an operator or the API hands it: base64 (standard or URL-safe, padded
    or not) of the 32 raw bytes."""
    try:
        raw = base64.b64decode(value + "=" * (-len(value) % 4), altchars=b"-_", validate=False)
    except (binascii.Error, ValueError):
        raise IngestKeyInvalid("the public key is not base64") from None
    return check_public_key(raw)


@dataclass(frozen=True)
class IngestKey:
    """A tenant's registered ingest public key (the raw 32 bytes)."""

    key_id: str
    public_key: bytes


def check_key_id(key_id: str) -> str:
    if not re.fullmatch(KEY_ID_PATTERN, key_id):
        raise IngestKeyInvalid(f"key id {key_id[:80]!r} is not 1-64 of A-Z a-z 0-9 . _ : -")
    return key_id


def check_public_key(raw: bytes) -> bytes:
    if len(raw) != PUBLIC_KEY_BYTES:
        raise IngestKeyInvalid(
            f"an Ed25519 public key has {PUBLIC_KEY_BYTES} bytes, not {len(raw)}"
        )
    try:
        Ed25519PublicKey.from_public_bytes(raw)
    except ValueError:
        raise IngestKeyInvalid("not an Ed25519 public key") from None
    return raw


def sign(private_key: Ed25519PrivateKey, value: bytes) -> bytes:
    """The ``kb-signature`` header of ``value`` (examples/ingest_folder.py)."""
    return base64.b64encode(private_key.sign(value))


def public_bytes(private_key: Ed25519PrivateKey) -> bytes:
    return private_key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def verify(key: IngestKey | None, value: bytes, signature: bytes | None) -> None:
    """``SignatureInvalid`` unless ``signature`` is ``key``'s over ``value``."""
    if signature is None:
        raise SignatureInvalid("the command is not signed (no kb-signature header)")
    if key is None:
        raise SignatureInvalid("the command's tenant has no such ingest key (or revoked it)")
    try:
        raw = base64.b64decode(signature, validate=True)
    except (binascii.Error, ValueError):
        raw = b""
    if len(raw) != SIGNATURE_BYTES:
        raise SignatureInvalid("kb-signature is not a base64 64-byte Ed25519 signature")
    try:
        _public_key(key.public_key).verify(raw, value)
    except InvalidSignature:
        raise SignatureInvalid(
            f"the signature does not verify with the tenant's key {key.key_id!r}"
        ) from None


@functools.lru_cache(maxsize=1024)
def _public_key(raw: bytes) -> Ed25519PublicKey:
    """The key loaded once, not per command: loading cost as much as verifying. Keyed by
    the bytes, so a revoked key is still refused (the key cache no longer gives it)."""
    return Ed25519PublicKey.from_public_bytes(raw)
