"""``KB_AUTH_*``: how ``kb serve`` checks principal tokens and throttles failed keys
(docs/security.md)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class AuthSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KB_AUTH_", frozen=True, extra="ignore")

    # The longest a principal token may live (its exp - iat): a stolen token is of use for
    # at most this long. Tokens claiming a longer life are refused, whatever their exp.
    principal_token_max_lifetime_seconds: int = Field(default=900, ge=1, le=86_400)
    # Clock difference tolerated between the token's issuer and this server (exp, nbf, iat).
    principal_token_leeway_seconds: int = Field(default=30, ge=0, le=300)
    # Failed authentications (401s) one client address may have in a burst before every
    # further /v1 request from it gets 429 without its key being looked at ...
    failed_auth_burst: int = Field(default=20, ge=1, le=100_000)
    # ... and how many more it earns per minute after that (a token bucket).
    failed_auth_per_minute: float = Field(default=30.0, gt=0, le=60_000)
    # Addresses whose failures are remembered (least recently failed forgotten first): the
    # throttle's memory stays bounded whatever the number of addresses trying.
    failed_auth_tracked_addresses: int = Field(default=10_000, ge=1, le=10_000_000)
