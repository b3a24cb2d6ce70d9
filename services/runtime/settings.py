"""Configuration by environment, frozen once read.

``DATABASE_URL`` and ``KAFKA_BOOTSTRAP_SERVERS`` keep their conventional names (managed
services and compose files set them); everything else is ``KB_*``. Each service has its own
settings model deriving from :class:`RuntimeSettings`, so a service reads only what it uses.
"""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class RuntimeSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="KB_", frozen=True, extra="ignore", populate_by_name=True
    )

    database_url: str = Field(
        default="postgresql://postgres@127.0.0.1:55432/kb",
        validation_alias=AliasChoices("DATABASE_URL", "KB_DATABASE_URL"),
    )
    kafka_bootstrap_servers: str = Field(
        default="127.0.0.1:59092",
        validation_alias=AliasChoices("KAFKA_BOOTSTRAP_SERVERS", "KB_KAFKA_BOOTSTRAP_SERVERS"),
    )
    # Prepended to every topic name; tests give each test its own prefix.
    kafka_topic_prefix: str = ""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["json", "console"] = "json"
    db_pool_min_size: int = Field(default=1, ge=0)
    db_pool_max_size: int = Field(default=10, ge=1)
    db_statement_timeout_ms: int = Field(default=30_000, ge=0)

    @field_validator("database_url")
    @classmethod
    def _postgres_url(cls, value: str) -> str:
        if not value.startswith(("postgresql://", "postgres://")):
            raise ValueError("DATABASE_URL must be a postgresql:// URL")
        return value

    def topic(self, name: str) -> str:
        return f"{self.kafka_topic_prefix}{name}"


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
