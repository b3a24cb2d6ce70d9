"""Operator sign-in: keys, sessions, CSRF tokens and the throttle of failed sign-ins. Pure
helpers; storage is the store's.

Operator keys look like ``kbop.<secret>`` and cannot be mistaken for tenant keys
(``kb.<tenant>.<secret>``): a tenant key never opens /ui, an operator key never opens /v1.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import Final

from services.operator.settings import OperatorSettings
from services.runtime.auth.settings import AuthSettings
from services.runtime.auth.throttle import FailedAuthThrottle

OPERATOR_KEY_PREFIX: Final = "kbop."
ENV_OPERATOR: Final = "env"
SESSION_COOKIE: Final = "kb_operator_session"


def new_operator_key() -> str:
    return OPERATOR_KEY_PREFIX + secrets.token_urlsafe(32)


def digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode("utf-8")).digest()


def new_session_token() -> str:
    return secrets.token_urlsafe(32)


def new_csrf_token() -> str:
    return secrets.token_urlsafe(24)


def same_secret(presented: str, expected: str) -> bool:
    return hmac.compare_digest(presented.encode("utf-8"), expected.encode("utf-8"))


def sign_in_throttle(settings: OperatorSettings) -> FailedAuthThrottle:
    """The failed-key throttle's buckets, addressed as for /v1 (``KB_AUTH_FAILED_AUTH_*``),
    with the sign-in's own allowance: an operator key opens every tenant's tasks."""
    return FailedAuthThrottle.from_settings(
        AuthSettings(),
        burst=settings.operator_sign_in_burst,
        per_minute=settings.operator_sign_in_per_minute,
    )
