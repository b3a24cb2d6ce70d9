"""Settings of the operator page (``KB_OPERATOR_*``), frozen once read."""

from __future__ import annotations

from typing import Any, Final

from pydantic import Field, SecretStr, field_validator
from pydantic_core import PydanticCustomError

from services.runtime.settings import RuntimeSettings

# An operator token opens every tenant's tasks: no shorter than a random 192-bit key
# written out (`kb operators create` makes 256-bit ones).
MIN_OPERATOR_TOKEN_CHARS: Final = 32


class OperatorSettings(RuntimeSettings):
    # A key kept outside the database (a secret store, an env file): it signs in as the
    # operator "env". Keys made by `kb operators create` work beside it. Empty: none.
    operator_token: SecretStr | None = None
    operator_session_seconds: float = Field(default=8 * 3600, gt=0, le=7 * 24 * 3600)
    # Leases ending within this many seconds count as "expiring" on the overview.
    operator_expiring_within_seconds: float = Field(default=10.0, gt=0)
    operator_page_size: int = Field(default=50, ge=1, le=500)
    # The session cookie's Secure flag: browsers send it over HTTPS only. Turn it off only
    # to use /ui over plain HTTP, as in local development (`kb demo` does).
    operator_secure_cookie: bool = True
    # Failed sign-ins one client address may have in a row before /ui/login answers it 429
    # without looking at its key, and how many more it earns per minute (the failed-key
    # throttle's buckets and addressing, KB_AUTH_FAILED_AUTH_*, with this allowance).
    operator_sign_in_burst: int = Field(default=10, ge=1, le=100_000)
    operator_sign_in_per_minute: float = Field(default=6.0, gt=0, le=60_000)
    # The budget `Requeue` grants, like `kb tasks requeue --reset-attempts`: the indexer's
    # KB_INDEXER_MAX_ATTEMPTS.
    indexer_max_attempts: int = Field(default=8, ge=1)

    @field_validator("operator_token", mode="before")
    @classmethod
    def _empty_is_none(cls, value: Any) -> Any:
        if value == "" or (isinstance(value, SecretStr) and not value.get_secret_value()):
            return None
        return value

    @field_validator("operator_token")
    @classmethod
    def _long_enough(cls, value: SecretStr | None) -> SecretStr | None:
        # The message names the length, never the value.
        if value is not None and len(value.get_secret_value()) < MIN_OPERATOR_TOKEN_CHARS:
            raise PydanticCustomError(
                "operator_token_too_short",
                # After "operator_token:" the log redaction masks one word: let it be "is".
                "is too short: KB_OPERATOR_TOKEN needs at least {least} characters (make one "
                "with: openssl rand -base64 32)",
                {"least": MIN_OPERATOR_TOKEN_CHARS},
            )
        return value
