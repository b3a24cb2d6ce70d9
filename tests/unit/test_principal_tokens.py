"""Verification keys are checked when registered, and token times against an injected
clock (services/runtime/auth/tokens.py; the attacks are in tests/security)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519, rsa

from services.runtime.auth.keys import VerificationKey
from services.runtime.auth.settings import AuthSettings
from services.runtime.auth.tokens import (
    PrincipalTokenInvalid,
    VerificationKeyInvalid,
    checked_key_material,
    default_algorithm,
    verify_principal_token,
)

ED = ed25519.Ed25519PrivateKey.generate()


def _pem(key: object) -> bytes:
    return key.public_key().public_bytes(  # type: ignore[attr-defined, no-any-return]
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )


@pytest.mark.parametrize(
    ("algorithm", "material"),
    [
        ("RS256", _pem(ED)),
        ("EdDSA", _pem(rsa.generate_private_key(public_exponent=65537, key_size=2048))),
        ("RS256", _pem(rsa.generate_private_key(public_exponent=65537, key_size=1024))),
        ("HS256", b"too short"),
        ("HS256", _pem(ED) * 2),
        ("none", b"x" * 40),
        ("ES256", _pem(ED)),
        ("EdDSA", b"-----BEGIN PUBLIC KEY-----\nnot base64\n-----END PUBLIC KEY-----\n"),
        ("EdDSA", b"\xff\xfe"),
    ],
)
def test_keys_that_cannot_verify_safely_are_refused(algorithm: str, material: bytes) -> None:
    with pytest.raises(VerificationKeyInvalid):
        checked_key_material(algorithm, material)


def test_the_default_algorithm_follows_the_key() -> None:
    assert default_algorithm(_pem(ED), hmac=False) == "EdDSA"
    big = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    assert default_algorithm(_pem(big), hmac=False) == "RS256"
    assert default_algorithm(b"s" * 40, hmac=True) == "HS256"


async def test_token_times_are_judged_by_the_clock_given() -> None:
    issued = datetime(2026, 1, 1, tzinfo=UTC)
    token = jwt.encode(
        {
            "sub": "user:a",
            "aud": "kb:acme",
            "iat": int(issued.timestamp()),
            "exp": int(issued.timestamp()) + 300,
            "principals": ["group:a"],
        },
        ED,
        algorithm="EdDSA",
        headers={"kid": "k"},
    )
    key = VerificationKey("k", "EdDSA", checked_key_material("EdDSA", _pem(ED)))

    async def find(kid: str) -> VerificationKey | None:
        return key if kid == "k" else None

    settings = AuthSettings(principal_token_leeway_seconds=30)

    async def verify(at: datetime) -> tuple[str, ...]:
        claims = await verify_principal_token(
            token,
            tenant_id="acme",
            find_key=find,
            settings=settings,
            max_principals=10,
            max_principal_chars=200,
            now=at,
        )
        return claims.principals

    assert await verify(issued + timedelta(seconds=299)) == ("group:a",)
    assert await verify(issued + timedelta(seconds=329)) == ("group:a",)  # within the leeway
    with pytest.raises(PrincipalTokenInvalid, match="expired"):
        await verify(issued + timedelta(seconds=330))
    with pytest.raises(PrincipalTokenInvalid, match="future"):
        await verify(issued - timedelta(seconds=31))
    with pytest.raises(PrincipalTokenInvalid):
        await verify_principal_token(
            token,
            tenant_id="globex",  # the audience is acme's
            find_key=find,
            settings=settings,
            max_principals=10,
            max_principal_chars=200,
            now=issued,
        )
