from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.indexer.settings import IndexerSettings
from services.relay.settings import RelaySettings
from services.runtime.errors import (
    BadInput,
    DatabaseUnavailable,
    KbError,
    LeaseLost,
    MigrationChecksumMismatch,
)
from services.runtime.settings import RuntimeSettings, env_names


def test_every_error_has_a_stable_code_and_a_retriable_flag() -> None:
    def walk(cls: type[KbError]) -> list[type[KbError]]:
        return [cls, *[c for sub in cls.__subclasses__() for c in walk(sub)]]

    classes = walk(KbError)
    codes = [c.code for c in classes]
    assert len(codes) == len(set(codes)), "two error classes share a code"
    assert all(code.isupper() for code in codes)
    assert DatabaseUnavailable.retriable
    assert not BadInput.retriable
    assert not MigrationChecksumMismatch.retriable
    assert LeaseLost.code == "LOST_LEASE"


def test_a_precise_code_can_ride_on_a_general_class() -> None:
    error = BadInput("empty file", code="EMPTY_FILE")
    assert error.code == "EMPTY_FILE"
    assert BadInput.code == "BAD_INPUT"
    assert str(error) == "EMPTY_FILE: empty file"


def test_settings_read_conventional_names_and_kb_prefix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DATABASE_URL", "postgresql://db.example/kb")
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", "kafka-1:9092")
    monkeypatch.setenv("KB_KAFKA_TOPIC_PREFIX", "staging.")
    settings = RuntimeSettings()
    assert settings.database_url == "postgresql://db.example/kb"
    assert settings.topic("kb.document-events") == "staging.kb.document-events"
    with pytest.raises(Exception, match="frozen"):
        settings.log_level = "debug"  # type: ignore[misc]


def test_bad_settings_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KB_DB_POOL_MAX_SIZE", "0")
    with pytest.raises(ValueError, match="db_pool_max_size"):
        RuntimeSettings()


def test_env_names_lists_what_a_model_reads() -> None:
    names = env_names(RuntimeSettings)
    assert {
        "DATABASE_URL",
        "KAFKA_BOOTSTRAP_SERVERS",
        "KB_KAFKA_TOPIC_PREFIX",
        "KB_LOG_LEVEL",
    } <= names


@pytest.mark.parametrize(
    ("service", "old"),
    [(service, old) for service in (IndexerSettings, RelaySettings) for old in service.renamed_env],
)
def test_an_old_name_left_in_the_environment_is_refused(
    monkeypatch: pytest.MonkeyPatch, service: type[RuntimeSettings], old: str
) -> None:
    monkeypatch.setenv(old, "1")
    with pytest.raises(ValidationError, match=service.renamed_env[old]):
        service()
    RuntimeSettings()  # a service's old names are its own
