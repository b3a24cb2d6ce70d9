"""``KB_AUTH_*``: how ``kb serve`` checks principal tokens and throttles failed keys
(docs/security.md)."""

from __future__ import annotations

from typing import Self

from pydantic import Field, model_validator
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
    # Clients whose failures are remembered (the one that would refill soonest forgotten
    # first): the throttle's memory stays bounded whatever the number of addresses trying,
    # and cycling through fresh addresses never pushes out a client that failed more.
    failed_auth_tracked_addresses: int = Field(default=10_000, ge=1, le=10_000_000)
    # An IPv6 client is its address's /N (a /64 is what one host is usually given) ...
    failed_auth_ipv6_prefix: int = Field(default=64, ge=16, le=128)
    # ... and it is counted in its /M as well (one site, or one attacker, often holds a
    # whole /48), whose allowance is failed_auth_ipv6_network_multiple clients' worth. An
    # M equal to N counts nothing beyond the client.
    failed_auth_ipv6_network_prefix: int = Field(default=48, ge=16, le=128)
    failed_auth_ipv6_network_multiple: int = Field(default=8, ge=1, le=1_000_000)

    @model_validator(mode="after")
    def _network_holds_the_client(self) -> Self:
        if self.failed_auth_ipv6_network_prefix > self.failed_auth_ipv6_prefix:
            raise ValueError(
                "KB_AUTH_FAILED_AUTH_IPV6_NETWORK_PREFIX must not be longer than "
                "KB_AUTH_FAILED_AUTH_IPV6_PREFIX (the network holds the client)"
            )
        return self
