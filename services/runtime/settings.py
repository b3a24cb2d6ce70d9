"""Configuration by environment, frozen once read.

``DATABASE_URL``, ``KAFKA_BOOTSTRAP_SERVERS`` and the Kafka connection security settings
(``KAFKA_SECURITY_PROTOCOL``, ``KAFKA_SASL_*``, ``KAFKA_SSL_CAFILE``) keep their conventional
names (managed services and compose files set them); everything else is ``KB_*``. Each
service has its own settings model deriving from :class:`RuntimeSettings`, so a service
reads only what it uses.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeVar

from pydantic import AliasChoices, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    Section = TypeVar("Section", bound=DataclassInstance)
else:
    Section = TypeVar("Section")


class RuntimeSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="KB_", frozen=True, extra="ignore", populate_by_name=True
    )

    database_url: str = Field(
        default="postgresql://postgres@127.0.0.1:25432/kb",
        validation_alias=AliasChoices("DATABASE_URL", "KB_DATABASE_URL"),
    )
    kafka_bootstrap_servers: str = Field(
        default="127.0.0.1:29092",
        validation_alias=AliasChoices("KAFKA_BOOTSTRAP_SERVERS", "KB_KAFKA_BOOTSTRAP_SERVERS"),
    )
    # How clients reach Kafka: PLAINTEXT (the dev stack), or TLS and/or SASL for a managed
    # cluster (services/runtime/messaging/kafka.py turns these into client arguments).
    kafka_security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = Field(
        default="PLAINTEXT",
        validation_alias=AliasChoices("KAFKA_SECURITY_PROTOCOL", "KB_KAFKA_SECURITY_PROTOCOL"),
    )
    kafka_sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] = Field(
        default="PLAIN",
        validation_alias=AliasChoices("KAFKA_SASL_MECHANISM", "KB_KAFKA_SASL_MECHANISM"),
    )
    kafka_sasl_username: str | None = Field(
        default=None,
        validation_alias=AliasChoices("KAFKA_SASL_USERNAME", "KB_KAFKA_SASL_USERNAME"),
    )
    # SecretStr: printed as '**********' in reprs, logs and validation errors.
    kafka_sasl_password: SecretStr | None = Field(
        default=None,
        validation_alias=AliasChoices("KAFKA_SASL_PASSWORD", "KB_KAFKA_SASL_PASSWORD"),
    )
    # CA bundle the broker's certificate is checked against (unset: the system's CAs).
    kafka_ssl_cafile: str | None = Field(
        default=None,
        validation_alias=AliasChoices("KAFKA_SSL_CAFILE", "KB_KAFKA_SSL_CAFILE"),
    )
    # Prepended to every topic name; tests give each test its own prefix.
    kafka_topic_prefix: str = ""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["json", "console"] = "json"
    db_pool_min_size: int = Field(default=1, ge=0)
    db_pool_max_size: int = Field(default=10, ge=1)
    db_statement_timeout_ms: int = Field(default=30_000, ge=0)
    # The second wall between tenants (docs/security.md): the API's tenant-scoped
    # transactions run as the role kb_tenant_api with the tenant set, so PostgreSQL's row
    # security returns and accepts only that tenant's rows. off: they run as the connecting
    # role, their own tenant filters the only wall. auto: on, except search where the
    # database's full-text match is not LEAKPROOF (services/runtime/tenancy/tenant_wall.py: there
    # the wall keeps keyword search off its full-text index).
    db_row_security: Literal["auto", "on", "off"] = "auto"

    # Names a service read before its settings were renamed (old -> new): see
    # refuse_renamed_env.
    renamed_env: ClassVar[Mapping[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _no_renamed_env(cls, values: Any) -> Any:
        refuse_renamed_env(cls.renamed_env)
        return values

    @field_validator("database_url")
    @classmethod
    def _postgres_url(cls, value: str) -> str:
        if not value.startswith(("postgresql://", "postgres://")):
            raise ValueError("DATABASE_URL must be a postgresql:// URL")
        return value

    @model_validator(mode="after")
    def _kafka_security_is_complete(self) -> RuntimeSettings:
        sasl = self.kafka_security_protocol.startswith("SASL_")
        tls = self.kafka_security_protocol.endswith("SSL")
        has_credentials = self.kafka_sasl_username or self.kafka_sasl_password
        if sasl and not (self.kafka_sasl_username and self.kafka_sasl_password):
            raise ValueError(
                f"KAFKA_SECURITY_PROTOCOL={self.kafka_security_protocol} needs "
                "KAFKA_SASL_USERNAME and KAFKA_SASL_PASSWORD"
            )
        if has_credentials and not sasl:
            raise ValueError(
                "KAFKA_SASL_USERNAME/KAFKA_SASL_PASSWORD are set but "
                f"KAFKA_SECURITY_PROTOCOL={self.kafka_security_protocol} does not use SASL "
                "(SASL_PLAINTEXT or SASL_SSL)"
            )
        if self.kafka_ssl_cafile and not tls:
            raise ValueError(
                "KAFKA_SSL_CAFILE is set but "
                f"KAFKA_SECURITY_PROTOCOL={self.kafka_security_protocol} does not use TLS "
                "(SSL or SASL_SSL)"
            )
        return self

    def topic(self, name: str) -> str:
        return f"{self.kafka_topic_prefix}{name}"


def refuse_renamed_env(renamed: Mapping[str, str]) -> None:
    """Refuse an environment that still sets an old name of ``renamed`` (old -> new):
    ignoring it would silently run with a default the operator meant to change."""
    left = sorted(name for name in renamed if name in os.environ)
    if left:
        raise ValueError(
            "renamed settings: " + ", ".join(f"{old} is now {renamed[old]}" for old in left)
        )


def env_names(settings_class: type[BaseSettings]) -> set[str]:
    """Every environment variable a settings model reads (its aliases or prefixed names)."""
    prefix = str(settings_class.model_config.get("env_prefix", ""))
    names: set[str] = set()
    for field_name, field in settings_class.model_fields.items():
        alias = field.validation_alias
        if isinstance(alias, AliasChoices):
            names.update(str(choice) for choice in alias.choices)
        elif isinstance(alias, str):
            names.add(alias)
        else:
            names.add(f"{prefix}{field_name}".upper())
    return names


def section_of(kind: type[Section], settings: BaseSettings, prefix: str, **given: Any) -> Section:
    """The dataclass ``kind`` (a policy, its timings) made from the settings named
    ``prefix`` and each of its fields: ``breaker_open_seconds`` is ``open_seconds`` of the
    ``breaker_`` section. ``given`` holds the fields whose value is not a setting of that
    name (another setting's, or one computed from settings). A field found in neither is an
    error, never its default: a setting renamed or a field added cannot go unnoticed."""
    values = dict(given)
    for field in dataclasses.fields(kind):
        if field.init and field.name not in values:
            values[field.name] = getattr(settings, prefix + field.name)
    return kind(**values)
