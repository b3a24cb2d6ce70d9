"""Searches as an end user (issue 29): a signed principal token decides the principals, a
bound key decides them, and every way of forging, stretching or borrowing a token fails
with 401 PRINCIPAL_TOKEN_INVALID and shows nothing."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from structlog.testing import capture_logs

from tests.security.test_auth_matrix import assert_no_leak
from tests.security.world import World

pytestmark = pytest.mark.integration


def _found(response: Any) -> set[str]:
    assert response.status_code == 200, response.text
    return {hit["documentId"] for hit in response.json()["results"]}


def _ids(world: World, principals: list[str]) -> set[str]:
    return {str(d) for d in world.acme.readable_by(principals)}


def _invalid(world: World, response: Any, code: str = "PRINCIPAL_TOKEN_INVALID") -> None:
    assert response.status_code == 401, response.text
    assert response.headers["content-type"] == "application/problem+json"
    assert response.json()["errorCode"] == code
    assert_no_leak(world, response)


@pytest.mark.parametrize("kid", ["ed", "rsa", "hmac"])
async def test_a_valid_token_searches_with_its_principals_only(world: World, kid: str) -> None:
    key, algorithm = {
        "ed": (world.signing.ed25519, "EdDSA"),
        "rsa": (world.signing.rsa, "RS256"),
        "hmac": (world.signing.hmac_secret, "HS256"),
    }[kid]
    token = world.token(["user:alice"], kid=kid, key=key, algorithm=algorithm)
    for kind in ("search", "token_only", "admin"):
        response = await world.search(world.acme.caller(kind), {"principalToken": token})
        assert _found(response) == _ids(world, ["user:alice"])


async def test_a_token_cannot_be_combined_with_principals(world: World) -> None:
    token = world.token(["user:alice"])
    response = await world.search(
        world.acme.caller("search"), {"principalToken": token, "principals": ["group:hr"]}
    )
    assert response.status_code == 400
    assert response.json()["errorCode"] == "PRINCIPALS_NOT_ALLOWED"
    assert_no_leak(world, response)


async def test_a_key_that_requires_a_token_refuses_principals(world: World) -> None:
    caller = world.acme.caller("token_only")
    _invalid(world, await world.search(caller, {}), "PRINCIPAL_TOKEN_REQUIRED")
    named = await world.search(caller, {"principals": ["group:hr"]})
    assert named.status_code == 400
    assert named.json()["errorCode"] == "PRINCIPALS_NOT_ALLOWED"


async def test_a_bound_key_searches_as_its_principals_and_nothing_else(world: World) -> None:
    caller = world.acme.caller("bound")
    assert _found(await world.search(caller, {})) == _ids(world, ["group:support"])
    bodies: list[dict[str, Any]] = [
        {"principals": ["group:hr"]},
        {"principals": []},
        {"principalToken": world.token(["group:hr"])},
    ]
    for body in bodies:
        response = await world.search(caller, body)
        assert response.status_code == 400, response.text
        assert response.json()["errorCode"] == "PRINCIPALS_NOT_ALLOWED"
        assert_no_leak(world, response)


async def test_a_search_without_principals_or_token_is_refused(world: World) -> None:
    response = await world.search(world.acme.caller("search"), {})
    assert response.status_code == 422
    assert response.json()["errorCode"] == "VALIDATION_FAILED"
    assert response.json()["errors"][0]["loc"] == ["body", "principals"]


def _unsigned(claims: dict[str, Any], header: dict[str, Any]) -> str:
    def part(value: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(value).encode()).rstrip(b"=").decode()

    return f"{part(header)}.{part(claims)}."


def _hs256(claims: dict[str, Any], header: dict[str, Any], secret: bytes) -> str:
    """A token HMAC-signed with ``secret`` (PyJWT itself refuses a public key as a secret:
    an attacker's code would not)."""
    unsigned = _unsigned(claims, header)[:-1]
    signature = hmac.new(secret, unsigned.encode(), hashlib.sha256).digest()
    return unsigned + "." + base64.urlsafe_b64encode(signature).rstrip(b"=").decode()


def _ed_public_pem(world: World) -> bytes:
    return world.signing.ed25519.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def _claims(**overrides: Any) -> dict[str, Any]:
    now = int(time.time())
    return {
        "sub": "user:mallory",
        "aud": "kb:acme",
        "iat": now,
        "exp": now + 60,
        "principals": ["group:hr"],
        **overrides,
    }


def _forgeries(world: World) -> dict[str, str]:
    now = time.time()
    rsa_public = world.signing.rsa_public_pem()
    other = ed25519.Ed25519PrivateKey.generate()
    return {
        "signed by another key": world.token(["group:hr"], key=other),
        "signed with globex's key under acme's kid": world.token(
            ["group:hr"], key=world.signing.stranger_ed25519
        ),
        "a payload swapped under a valid signature": _swap_payload(world),
        "expired": world.token(["group:hr"], issued_at=now - 400, lifetime=300),
        "living longer than allowed": world.token(["group:hr"], lifetime=3600),
        "issued in the future": world.token(["group:hr"], issued_at=now + 600),
        "not valid yet": world.token(["group:hr"], extra={"nbf": int(now) + 600}),
        "without exp": world.token(["group:hr"], drop=["exp"]),
        "without iat": world.token(["group:hr"], drop=["iat"]),
        "without sub": world.token(["group:hr"], drop=["sub"]),
        "without aud": world.token(["group:hr"], drop=["aud"]),
        "for another audience": world.token(["group:hr"], extra={"aud": "kb:globex"}),
        "with several audiences": world.token(["group:hr"], extra={"aud": ["kb:acme", "x"]}),
        "without principals": world.token(None),
        "principals not a list": world.token(None, extra={"principals": "group:hr"}),
        "a principal not a string": world.token(None, extra={"principals": [{"$ne": ""}]}),
        "an empty principal": world.token([""]),
        "1001 principals": world.token([f"g:{i}" for i in range(1001)]),
        "alg none": _unsigned(_claims(), {"alg": "none", "kid": "ed", "typ": "JWT"}),
        "alg none for an hmac kid": _unsigned(_claims(), {"alg": "none", "kid": "hmac"}),
        "HS256 keyed with the RSA public key": _hs256(
            _claims(), {"alg": "HS256", "kid": "rsa"}, rsa_public
        ),
        "RS256 under the Ed25519 kid": world.token(
            ["group:hr"], key=world.signing.rsa, algorithm="RS256", kid="ed"
        ),
        "HS256 under the Ed25519 kid, keyed with its public key": _hs256(
            _claims(), {"alg": "HS256", "kid": "ed"}, _ed_public_pem(world)
        ),
        "an unknown kid": world.token(["group:hr"], kid="nope"),
        "no kid": jwt.encode(_claims(), world.signing.ed25519, algorithm="EdDSA"),
        "garbage": "not.a.token",
        "a JSON object": json.dumps(_claims()),
    }


def _swap_payload(world: World) -> str:
    header, _, signature = world.token(["user:alice"]).split(".")
    payload = base64.urlsafe_b64encode(json.dumps(_claims()).encode()).rstrip(b"=").decode()
    return f"{header}.{payload}.{signature}"


FORGERIES = [
    "signed by another key",
    "signed with globex's key under acme's kid",
    "a payload swapped under a valid signature",
    "expired",
    "living longer than allowed",
    "issued in the future",
    "not valid yet",
    "without exp",
    "without iat",
    "without sub",
    "without aud",
    "for another audience",
    "with several audiences",
    "without principals",
    "principals not a list",
    "a principal not a string",
    "an empty principal",
    "1001 principals",
    "alg none",
    "alg none for an hmac kid",
    "HS256 keyed with the RSA public key",
    "RS256 under the Ed25519 kid",
    "HS256 under the Ed25519 kid, keyed with its public key",
    "an unknown kid",
    "no kid",
    "garbage",
    "a JSON object",
]


@pytest.mark.parametrize("forgery", FORGERIES)
async def test_a_forged_or_stale_token_is_refused(world: World, forgery: str) -> None:
    token = _forgeries(world)[forgery]
    response = await world.search(world.acme.caller("search"), {"principalToken": token})
    if forgery == "1001 principals" and response.status_code == 413:
        return  # larger than the search body may be: refused before it is read
    _invalid(world, response)


def test_every_forgery_is_tried(world: World) -> None:
    assert sorted(_forgeries(world)) == sorted(FORGERIES)


async def test_another_tenants_token_is_refused(world: World) -> None:
    # A token globex's back end signed (its own key, its own audience) ...
    theirs = world.token(["group:support"], tenant_id="globex", key=world.signing.stranger_ed25519)
    assert _found(
        await world.search(world.globex.caller("search"), {"principalToken": theirs})
    ) == {str(d) for d in world.globex.readable_by(["group:support"])}
    # ... is no token of acme's, not even where both tenants verify with one key (rsa).
    _invalid(world, await world.search(world.acme.caller("search"), {"principalToken": theirs}))
    shared = world.token(
        ["group:support"], tenant_id="globex", key=world.signing.rsa, algorithm="RS256", kid="rsa"
    )
    _invalid(world, await world.search(world.acme.caller("search"), {"principalToken": shared}))


async def test_a_token_of_1000_principals_is_served(world: World) -> None:
    principals = [f"g:{i:04d}" for i in range(999)] + ["group:hr"]
    token = world.token(principals)
    response = await world.search(world.acme.caller("search"), {"principalToken": token})
    assert _found(response) == _ids(world, ["group:hr"])


async def test_the_logs_name_no_key_token_or_document_text(world: World) -> None:
    token = world.token(["user:alice"])
    with capture_logs() as events:
        await world.search(world.acme.caller("search"), {"principalToken": token})
        await world.search(world.acme.caller("search"), {"principalToken": token[:-4] + "AAAA"})
        await world.search(world.acme.caller("revoked"), {"principals": ["group:hr"]})
        await world.search(world.acme.caller("admin"), {"principals": ["group:hr"]})
    assert any(event["event"] == "search.served" for event in events)
    logged = repr(events)
    for secret in [*world.secrets, token, token.split(".")[2]]:
        assert secret not in logged
