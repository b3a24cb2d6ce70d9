"""compose.yaml agrees with the code: images, commands and environment names."""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

import typer.main
import yaml
from typer.core import TyperGroup

import services
from services.cli import app
from services.runtime.settings import RuntimeSettings, env_names
from services.runtime.tracing.setup import ENV_NAMES as TRACING_ENV_NAMES
from tests.support.stack import REPO_ROOT


def _compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((REPO_ROOT / "compose.yaml").read_text())
    return loaded


def _all_settings_env_names() -> set[str]:
    for module in pkgutil.walk_packages(services.__path__, "services."):
        importlib.import_module(module.name)
    names = set()
    pending: list[type[RuntimeSettings]] = [RuntimeSettings]
    while pending:
        cls = pending.pop()
        names |= env_names(cls)
        pending.extend(cls.__subclasses__())
    return names


def _kb_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        name: spec
        for name, spec in compose["services"].items()
        if spec.get("image", "").startswith("kb-pipeline")
    }


def test_infrastructure_images_are_the_real_servers() -> None:
    services_ = _compose()["services"]
    assert services_["postgres"]["image"].startswith("pgvector/pgvector:pg18")
    assert services_["kafka"]["image"].startswith("apache/kafka:4.")
    for name in ("postgres", "kafka"):
        assert "healthcheck" in services_[name], f"{name} has no healthcheck"


def test_the_three_services_run_from_the_project_image() -> None:
    kb = _kb_services(_compose())
    commands = {tuple(spec["command"][:2]) for spec in kb.values()}
    assert ("serve", "--host") in commands
    assert ("relay", "run") in commands
    assert any(c[0] == "indexer" for c in commands)
    assert "migrate" in {spec["command"][0] for spec in kb.values()}


def test_every_service_command_exists_in_the_cli() -> None:
    root = typer.main.get_command(app)
    for name, spec in _kb_services(_compose()).items():
        words = [w for w in spec["command"] if not w.startswith("-")]
        command: object = root
        for word in words:
            if not isinstance(command, TyperGroup):
                break
            sub = command.get_command(typer.Context(command), word)
            assert sub is not None, f"compose service {name}: `kb {' '.join(words)}` is unknown"
            command = sub


def test_every_environment_name_is_read_by_the_code() -> None:
    known = _all_settings_env_names() | TRACING_ENV_NAMES
    for name, spec in _kb_services(_compose()).items():
        env = spec.get("environment") or {}
        for key in env:
            assert key in known, f"compose service {name} sets {key}, which no settings read"
        assert {"DATABASE_URL", "KAFKA_BOOTSTRAP_SERVERS"} <= set(env), name


def test_every_host_port_binds_loopback_only() -> None:
    # Docker publishes "HOST:CONTAINER" on every interface: the database and the broker
    # (no TLS, trust or default passwords) must not be reachable from the network.
    for name, spec in _compose()["services"].items():
        for mapping in spec.get("ports", []):
            assert str(mapping).startswith("127.0.0.1:"), f"{name} publishes {mapping}"


def test_durations_are_named_in_seconds() -> None:
    for name, spec in _kb_services(_compose()).items():
        for key in spec.get("environment") or {}:
            assert not key.endswith(("_S", "_MS", "_HOURS")), f"{name}: {key} is not *_SECONDS"


def test_the_relay_is_configured_with_its_own_names() -> None:
    env = _kb_services(_compose())["relay"]["environment"]
    assert "KB_RELAY_LEASE_SECONDS" in env
    assert {k for k in env if k.startswith("KB_") and not k.startswith("KB_LOG_")} <= {
        k for k in env if k.startswith("KB_RELAY_")
    }


def test_tracing_is_an_optional_profile_the_services_export_to_when_asked() -> None:
    compose = _compose()
    backend = compose["services"]["jaeger"]
    assert backend["profiles"] == ["tracing"]
    for name, spec in _kb_services(compose).items():
        # Empty unless the operator names the backend: tracing stays off by default.
        assert spec["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == (
            "${OTEL_EXPORTER_OTLP_ENDPOINT:-}"
        ), name
