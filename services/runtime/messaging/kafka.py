"""The connection arguments every aiokafka client (producer, consumer, admin) is built with.

One mapping from :class:`~services.runtime.settings.RuntimeSettings` to aiokafka's keyword
arguments, so the relay's producer and admin client and the indexer's hint consumer reach
a managed Kafka (TLS, SASL PLAIN/SCRAM) the same way.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable
from typing import Any

from aiokafka.helpers import create_ssl_context

from services.runtime.errors import ConfigError
from services.runtime.settings import RuntimeSettings


def kafka_client_kwargs(
    settings: RuntimeSettings,
    *,
    ssl_context_factory: Callable[..., ssl.SSLContext] = create_ssl_context,
) -> dict[str, Any]:
    """``bootstrap_servers``, ``security_protocol`` and, where the protocol needs them, the
    TLS context and SASL credentials (the password only here, never in a log line)."""
    protocol = settings.kafka_security_protocol
    kwargs: dict[str, Any] = {
        "bootstrap_servers": settings.kafka_bootstrap_servers,
        "security_protocol": protocol,
    }
    if protocol in ("SSL", "SASL_SSL"):
        try:
            kwargs["ssl_context"] = ssl_context_factory(cafile=settings.kafka_ssl_cafile)
        except (OSError, ssl.SSLError) as error:
            raise ConfigError(
                f"KAFKA_SSL_CAFILE {settings.kafka_ssl_cafile!r} cannot be used: {error}"
            ) from None
    if protocol in ("SASL_PLAINTEXT", "SASL_SSL"):
        assert settings.kafka_sasl_password is not None  # the settings validate it
        kwargs["sasl_mechanism"] = settings.kafka_sasl_mechanism
        kwargs["sasl_plain_username"] = settings.kafka_sasl_username
        kwargs["sasl_plain_password"] = settings.kafka_sasl_password.get_secret_value()
    return kwargs
