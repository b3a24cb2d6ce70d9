"""Relay and Kafka connection settings: names, validation, and what aiokafka is given."""

from __future__ import annotations

import ssl
from typing import Any

import pytest
from pydantic import ValidationError

from services.relay.settings import RelaySettings
from services.relay.sink_kafka import new_topic
from services.runtime.errors import ConfigError
from services.runtime.messaging.kafka import kafka_client_kwargs
from services.runtime.settings import RuntimeSettings

PASSWORD = "s3cr3t-Pa55word"


class _Contexts:
    def __init__(self) -> None:
        self.cafiles: list[object] = []

    def __call__(self, **kwargs: Any) -> ssl.SSLContext:
        self.cafiles.append(kwargs.get("cafile"))
        return ssl.create_default_context()


def test_plaintext_gives_only_the_servers_and_the_protocol() -> None:
    settings = RuntimeSettings(kafka_bootstrap_servers="k1:9092,k2:9092")
    assert kafka_client_kwargs(settings) == {
        "bootstrap_servers": "k1:9092,k2:9092",
        "security_protocol": "PLAINTEXT",
    }


def test_ssl_gets_a_context_from_the_ca_file() -> None:
    contexts = _Contexts()
    settings = RuntimeSettings(kafka_security_protocol="SSL", kafka_ssl_cafile="/etc/ca.pem")
    kwargs = kafka_client_kwargs(settings, ssl_context_factory=contexts)
    assert kwargs["security_protocol"] == "SSL"
    assert isinstance(kwargs["ssl_context"], ssl.SSLContext)
    assert contexts.cafiles == ["/etc/ca.pem"]
    assert "sasl_mechanism" not in kwargs


@pytest.mark.parametrize(("protocol", "with_tls"), [("SASL_SSL", True), ("SASL_PLAINTEXT", False)])
def test_sasl_passes_mechanism_and_credentials(protocol: str, with_tls: bool) -> None:
    settings = RuntimeSettings(
        kafka_security_protocol=protocol,
        kafka_sasl_mechanism="SCRAM-SHA-512",
        kafka_sasl_username="relay",
        kafka_sasl_password=PASSWORD,
    )
    kwargs = kafka_client_kwargs(settings, ssl_context_factory=_Contexts())
    assert kwargs["sasl_mechanism"] == "SCRAM-SHA-512"
    assert kwargs["sasl_plain_username"] == "relay"
    assert kwargs["sasl_plain_password"] == PASSWORD
    assert ("ssl_context" in kwargs) is with_tls


def test_the_sasl_password_is_never_shown() -> None:
    settings = RuntimeSettings(
        kafka_security_protocol="SASL_SSL",
        kafka_sasl_username="relay",
        kafka_sasl_password=PASSWORD,
    )
    assert PASSWORD not in repr(settings)
    assert PASSWORD not in str(settings.model_dump())


def test_the_environment_names_are_the_conventional_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KAFKA_SECURITY_PROTOCOL", "SASL_SSL")
    monkeypatch.setenv("KAFKA_SASL_MECHANISM", "SCRAM-SHA-256")
    monkeypatch.setenv("KAFKA_SASL_USERNAME", "relay")
    monkeypatch.setenv("KAFKA_SASL_PASSWORD", PASSWORD)
    monkeypatch.setenv("KAFKA_SSL_CAFILE", "/etc/ca.pem")
    settings = RelaySettings()
    assert settings.kafka_security_protocol == "SASL_SSL"
    assert settings.kafka_sasl_mechanism == "SCRAM-SHA-256"
    assert settings.kafka_ssl_cafile == "/etc/ca.pem"
    assert settings.kafka_sasl_password is not None
    assert settings.kafka_sasl_password.get_secret_value() == PASSWORD


@pytest.mark.parametrize(
    ("values", "complaint"),
    [
        ({"kafka_security_protocol": "SASL_SSL", "kafka_sasl_password": PASSWORD}, "USERNAME"),
        ({"kafka_security_protocol": "SASL_PLAINTEXT", "kafka_sasl_username": "u"}, "PASSWORD"),
        ({"kafka_sasl_username": "u", "kafka_sasl_password": PASSWORD}, "does not use SASL"),
        ({"kafka_ssl_cafile": "/etc/ca.pem"}, "does not use TLS"),
        ({"kafka_security_protocol": "TLS"}, "kafka_security_protocol"),
        ({"kafka_sasl_mechanism": "GSSAPI"}, "kafka_sasl_mechanism"),
    ],
)
def test_incomplete_security_settings_are_refused(values: dict[str, str], complaint: str) -> None:
    with pytest.raises(ValidationError, match=complaint) as raised:
        RuntimeSettings.model_validate(values)
    assert PASSWORD not in str(raised.value.errors(include_input=False))


def test_an_unreadable_ca_file_is_a_config_error(tmp_path: Any) -> None:
    settings = RuntimeSettings(
        kafka_security_protocol="SSL", kafka_ssl_cafile=str(tmp_path / "missing.pem")
    )
    with pytest.raises(ConfigError, match="KAFKA_SSL_CAFILE"):
        kafka_client_kwargs(settings)


def test_relay_durations_are_named_in_seconds_and_old_names_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KB_RELAY_LEASE_SECONDS", "20")
    monkeypatch.setenv("KB_RELAY_POLL_INTERVAL_SECONDS", "0.25")
    settings = RelaySettings()
    assert (settings.relay_lease_seconds, settings.relay_poll_interval_seconds) == (20.0, 0.25)
    monkeypatch.setenv("KB_RELAY_LEASE_S", "20")
    with pytest.raises(ValidationError, match="KB_RELAY_LEASE_S is now KB_RELAY_LEASE_SECONDS"):
        RelaySettings()


def test_the_metrics_listener_stays_on_loopback_unless_told() -> None:
    assert RelaySettings().relay_metrics_host == "127.0.0.1"
    assert RelaySettings(relay_metrics_host="0.0.0.0").relay_metrics_host == "0.0.0.0"


def test_a_send_timeout_longer_than_the_trusted_lease_is_refused() -> None:
    with pytest.raises(ValidationError, match="relay_send_timeout_seconds"):
        RelaySettings(relay_lease_seconds=2.0, relay_send_timeout_seconds=5.0)
    assert RelaySettings(relay_lease_seconds=10.0, relay_send_timeout_seconds=5.0)


def test_topics_take_the_brokers_replication_factor_unless_set() -> None:
    assert RelaySettings().relay_topic_replication_factor is None
    assert new_topic("t", 3, None).replication_factor == -1
    assert new_topic("t", 3, 3).replication_factor == 3
