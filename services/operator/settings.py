"""Settings of the operator page (``KB_OPERATOR_*``), frozen once read."""

from __future__ import annotations

from pydantic import Field, SecretStr

from services.runtime.settings import RuntimeSettings


class OperatorSettings(RuntimeSettings):
    # A key kept outside the database (a secret store, an env file): it signs in as the
    # operator "env". Keys made by `kb operators create` work beside it.
    operator_token: SecretStr | None = None
    operator_session_seconds: float = Field(default=8 * 3600, gt=0, le=7 * 24 * 3600)
    # Leases ending within this many seconds count as "expiring" on the overview.
    operator_expiring_within_seconds: float = Field(default=10.0, gt=0)
    operator_page_size: int = Field(default=50, ge=1, le=500)
    # Set the Secure flag on the session cookie (serve /ui over HTTPS behind a proxy).
    operator_secure_cookie: bool = False
    # The budget `Requeue` grants, like `kb tasks requeue --reset-attempts`: the indexer's
    # KB_INDEXER_MAX_ATTEMPTS.
    indexer_max_attempts: int = Field(default=8, ge=1)
