"""Signed principal tokens (docs/security.md#principal-tokens): an end user's search carries
a short-lived JWT, signed by the tenant's own back end or identity provider, naming the
subject and the principals it may search as; the API then searches with exactly those.

A token is checked against the verification keys of the tenant whose API key came with it
(``kid`` in its header names one): the signature with the one algorithm that key accepts
(never ``none``, never an HMAC check keyed with a public key), ``aud`` (the key's audience,
by default ``kb:<tenant>``), ``iss`` when the key names an issuer, ``exp`` and ``iat``
required, a lifetime no longer than ``KB_AUTH_PRINCIPAL_TOKEN_MAX_LIFETIME_SECONDS``,
``nbf`` when present. A header or payload naming a key twice is refused (a JSON parser
keeps the last, perhaps not the one the issuer meant; request bodies are refused alike).
Any failure is 401 ``PRINCIPAL_TOKEN_INVALID``; the token itself is never logged or echoed.
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

import jwt
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.rsa import RSAPublicKey
from cryptography.hazmat.primitives.serialization import load_pem_public_key

from services.runtime.auth.keys import VerificationKey
from services.runtime.auth.settings import AuthSettings
from services.runtime.errors import BadInput, Unauthenticated
from services.runtime.web.http_strict import DuplicateJsonKey, strict_json_loads

EDDSA: Final = "EdDSA"
RSA_ALGORITHMS: Final = frozenset({"RS256", "RS384", "RS512", "PS256", "PS384", "PS512"})
HMAC_ALGORITHMS: Final = frozenset({"HS256", "HS384", "HS512"})
ALGORITHMS: Final = frozenset({EDDSA, *RSA_ALGORITHMS, *HMAC_ALGORITHMS})
MIN_RSA_BITS: Final = 2048
MIN_HMAC_SECRET_BYTES: Final = 32
# A token larger than this is refused unread (the search body's own limit is smaller by
# default; this bounds the work should that limit be raised).
MAX_TOKEN_CHARS: Final = 256 * 1024
MAX_SUBJECT_CHARS: Final = 200
KID_PATTERN: Final = r"^[A-Za-z0-9._:-]{1,64}$"


class PrincipalTokenInvalid(Unauthenticated, code="PRINCIPAL_TOKEN_INVALID"):
    """The principal token is not one this tenant signed, or is no longer valid."""


class VerificationKeyInvalid(BadInput, code="VERIFICATION_KEY_INVALID"):
    """A verification key that cannot be registered (wrong kind for its algorithm, too
    weak, not a PEM public key)."""


@dataclass(frozen=True)
class PrincipalClaims:
    subject: str
    principals: tuple[str, ...]
    kid: str


def default_audience(tenant_id: str) -> str:
    return f"kb:{tenant_id}"


def default_algorithm(key_material: bytes, *, hmac: bool) -> str:
    """The algorithm a key is registered with when none is named: its kind's usual one."""
    if hmac:
        return "HS256"
    key = _load_public_key(key_material)
    return EDDSA if isinstance(key, Ed25519PublicKey) else "RS256"


def checked_key_material(algorithm: str, key_material: bytes) -> str:
    """``key_material`` as stored, once it is known to be a key ``algorithm`` can verify
    with (:class:`VerificationKeyInvalid` otherwise)."""
    if algorithm not in ALGORITHMS:
        raise VerificationKeyInvalid(
            f"algorithm {algorithm!r} is not accepted: use one of {', '.join(sorted(ALGORITHMS))}"
        )
    try:
        text = key_material.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise VerificationKeyInvalid("the key must be UTF-8 text (a PEM or a secret)") from None
    if algorithm in HMAC_ALGORITHMS:
        if len(text.encode()) < MIN_HMAC_SECRET_BYTES:
            raise VerificationKeyInvalid(
                f"an HMAC secret must be at least {MIN_HMAC_SECRET_BYTES} bytes"
            )
        if "-----BEGIN" in text:
            raise VerificationKeyInvalid("an HMAC secret must not be a PEM key")
    _verifying_key(algorithm, text)
    return text


def _load_public_key(material: bytes) -> Any:
    try:
        return load_pem_public_key(material)
    except (ValueError, TypeError):
        raise VerificationKeyInvalid(
            "not a PEM public key (-----BEGIN PUBLIC KEY-----); for an HMAC secret use "
            "--hmac-secret-file"
        ) from None


def _verifying_key(algorithm: str, material: str) -> Any:
    """The key object ``algorithm`` verifies with; its kind must be the algorithm's, so a
    public key can never be used as an HMAC secret nor an RSA key for EdDSA."""
    if algorithm in HMAC_ALGORITHMS:
        return material.encode("utf-8")
    key = _load_public_key(material.encode("utf-8"))
    if algorithm == EDDSA:
        if not isinstance(key, Ed25519PublicKey):
            raise VerificationKeyInvalid("EdDSA needs an Ed25519 public key")
        return key
    if not isinstance(key, RSAPublicKey):
        raise VerificationKeyInvalid(f"{algorithm} needs an RSA public key")
    if key.key_size < MIN_RSA_BITS:
        raise VerificationKeyInvalid(f"an RSA key must have at least {MIN_RSA_BITS} bits")
    return key


KeyLookup = Callable[[str], Awaitable[VerificationKey | None]]


async def verify_principal_token(
    token: str,
    *,
    tenant_id: str,
    find_key: KeyLookup,
    settings: AuthSettings,
    max_principals: int,
    max_principal_chars: int,
    now: datetime | None = None,
) -> PrincipalClaims:
    """The subject and principals of a valid token of ``tenant_id`` (``find_key`` looks a
    kid up among that tenant's verification keys only)."""
    if not token or len(token) > MAX_TOKEN_CHARS:
        raise PrincipalTokenInvalid("the principal token is empty or too large")
    _refuse_duplicate_keys(token)
    try:
        header = jwt.get_unverified_header(token)
    except jwt.PyJWTError:
        raise PrincipalTokenInvalid("the principal token is not a signed JWT") from None
    kid = header.get("kid")
    if not isinstance(kid, str) or not kid or len(kid) > 64:
        raise PrincipalTokenInvalid("the principal token's header names no kid")
    key = await find_key(kid)
    if key is None:
        raise PrincipalTokenInvalid("the principal token's kid names no verification key")
    if header.get("alg") != key.algorithm:
        raise PrincipalTokenInvalid(
            f"the principal token is not signed with {key.algorithm}, the only algorithm "
            "its verification key accepts"
        )
    try:
        claims: dict[str, Any] = jwt.decode(
            token,
            key=_verifying_key(key.algorithm, key.key_material),
            algorithms=[key.algorithm],
            audience=key.audience or default_audience(tenant_id),
            issuer=key.issuer,
            options={
                "require": ["exp", "iat", "sub", "aud"],
                # The times are checked below, against an injectable clock.
                "verify_exp": False,
                "verify_nbf": False,
                "verify_iat": False,
                "strict_aud": True,
            },
        )
    except jwt.PyJWTError as error:
        raise PrincipalTokenInvalid(f"the principal token is invalid: {_reason(error)}") from None
    except VerificationKeyInvalid:  # a stored key that no longer loads: refuse, never 500
        raise PrincipalTokenInvalid("the principal token's verification key is unusable") from None
    _check_times(claims, settings, now or datetime.now(UTC))
    return PrincipalClaims(
        subject=_subject(claims),
        principals=_principals(claims, max_principals, max_principal_chars),
        kid=kid,
    )


def _refuse_duplicate_keys(token: str) -> None:
    """Refuse a token whose header or payload names a key twice, before PyJWT reads them
    with a parser that keeps the last. Anything else malformed is left to PyJWT."""
    for segment in token.split(".")[:2]:
        try:
            text = base64.urlsafe_b64decode(segment + "=" * (-len(segment) % 4))
        except (binascii.Error, ValueError):
            continue
        try:
            strict_json_loads(text)
        except DuplicateJsonKey:
            raise PrincipalTokenInvalid(
                "the principal token's header or payload names a key twice (duplicate keys "
                "are refused)"
            ) from None
        except RecursionError:  # nested past the parser's depth: never a 500
            raise PrincipalTokenInvalid("the principal token is invalid: malformed") from None
        except ValueError:  # not JSON (or not UTF-8): PyJWT says so below
            continue


def _reason(error: jwt.PyJWTError) -> str:
    reasons: list[tuple[type[jwt.PyJWTError], str]] = [
        (jwt.InvalidSignatureError, "bad signature"),
        (jwt.InvalidAudienceError, "wrong audience"),
        (jwt.InvalidIssuerError, "wrong issuer"),
        (jwt.MissingRequiredClaimError, "a required claim (exp, iat, sub, aud) is missing"),
        (jwt.InvalidAlgorithmError, "algorithm not accepted"),
    ]
    for kind, reason in reasons:
        if isinstance(error, kind):
            return reason
    return "malformed"


def _number(claims: dict[str, Any], name: str) -> float:
    value = claims.get(name)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise PrincipalTokenInvalid(f"the principal token's {name} is not a number")
    return float(value)


def _check_times(claims: dict[str, Any], settings: AuthSettings, now: datetime) -> None:
    at = now.timestamp()
    leeway = settings.principal_token_leeway_seconds
    exp, iat = _number(claims, "exp"), _number(claims, "iat")
    if exp <= at - leeway:
        raise PrincipalTokenInvalid("the principal token has expired")
    if iat > at + leeway:
        raise PrincipalTokenInvalid("the principal token was issued in the future")
    if "nbf" in claims and _number(claims, "nbf") > at + leeway:
        raise PrincipalTokenInvalid("the principal token is not valid yet")
    if exp - iat > settings.principal_token_max_lifetime_seconds:
        raise PrincipalTokenInvalid(
            "the principal token lives longer than "
            f"{settings.principal_token_max_lifetime_seconds} s (exp - iat)"
        )


def _subject(claims: dict[str, Any]) -> str:
    subject = claims.get("sub")
    if not isinstance(subject, str) or not subject.strip() or len(subject) > MAX_SUBJECT_CHARS:
        raise PrincipalTokenInvalid("the principal token's sub is not a usable string")
    return subject


def _principals(claims: dict[str, Any], limit: int, max_chars: int) -> tuple[str, ...]:
    principals = claims.get("principals")
    if not isinstance(principals, list) or len(principals) > limit:
        raise PrincipalTokenInvalid(
            f"the principal token's principals claim must be a list of at most {limit} strings"
        )
    for principal in principals:
        if (
            not isinstance(principal, str)
            or not principal
            or len(principal) > max_chars
            or "\x00" in principal
        ):
            raise PrincipalTokenInvalid(
                f"each principal in the token must be a string of 1 to {max_chars} characters"
            )
    return tuple(principals)
