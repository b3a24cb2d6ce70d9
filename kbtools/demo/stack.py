"""What the demo runs: the dev stack, tenants and an operator key made with `kb`, and its
child processes (API, two relays, an indexer pool per tier, the embedding provider)."""

from __future__ import annotations

import os
import socket
import sys
import uuid
from pathlib import Path
from typing import Any

from kbtools.demo.client import ApiClient, Tenant
from kbtools.demo.console import Console, Step
from kbtools.demo.processes import DemoProcesses
from kbtools.devstack.process import run_tool

MODEL = "all-MiniLM-L6-v2-onnx-int8"
TENANTS = (("acme", "standard"), ("globex", "premium"))
_KEPT = frozenset({"KB_KAFKA_TOPIC_PREFIX"})


def free_port(preferred: int | None = None) -> int:
    if preferred is not None:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", preferred)) != 0:
                return preferred
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class DemoStack:
    def __init__(self, home: Path, *, api_port: int) -> None:
        self.home = home
        self.processes = DemoProcesses(home)
        self.values: dict[str, Any] = self.processes.state.values
        self.preferred_api_port = api_port
        self.env: dict[str, str] = {}

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.values['api_port']}"

    @property
    def provider_url(self) -> str:
        return f"http://127.0.0.1:{self.values['provider_port']}"

    def tenant(self, role: str) -> Tenant:
        """The tenant playing ``role`` (acme or globex) in this database."""
        found = self.values["tenants"][role]
        return Tenant(found.get("id", role), found["tier"], found["key"])

    def log(self, name: str) -> str:
        return str(self.home / f"{name}.log")

    def kb(self, *args: str, env: dict[str, str] | None = None) -> str:
        done = run_tool(
            [sys.executable, "-m", "services.cli", *args], env=env or self.env, timeout=900
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"kb {' '.join(args)} exited {done.returncode}: {done.stderr[-800:]}"
            )
        return done.stdout

    def bring_up(self, console: Console) -> ApiClient:
        with console.step("PostgreSQL + pgvector and Kafka") as step:
            # The story sets its own KB_* settings; only where things run is taken over.
            env = {
                k: v
                for k, v in os.environ.items()
                if not k.startswith("KB_") or k in _KEPT or k.startswith("KB_DEV_")
            }
            if "DATABASE_URL" in env and "KAFKA_BOOTSTRAP_SERVERS" in env:
                where = "external services (DATABASE_URL, KAFKA_BOOTSTRAP_SERVERS)"
            else:
                for line in self.kb("dev", "up", env=dict(os.environ)).splitlines():
                    name, _, value = line.partition("=")
                    if name in ("DATABASE_URL", "KAFKA_BOOTSTRAP_SERVERS"):
                        env[name] = value
                where = "the embedded default (kb dev up)"
            env["KB_LOG_FORMAT"] = "json"
            # The operator page is served over plain HTTP here: a Secure session cookie
            # would not come back from every browser.
            env["KB_OPERATOR_SECURE_COOKIE"] = "false"
            self.env = env
            self.kb("migrate")
            step.done(f"{where}, migrated")

        with console.step("tenants and an operator key") as step:
            tenants = self.values.setdefault("tenants", {})
            for tenant_id, tier in TENANTS:
                if tenant_id not in tenants:
                    tenants[tenant_id] = self.create_tenant(tenant_id, tier)
            if "operator_key" not in self.values:
                name = f"demo-{uuid.uuid4().hex[:6]}"
                key = self.kb("operators", "create", name).strip()
                self.values["operator_key"] = key.removeprefix("KB_OPERATOR_KEY=")
            self.processes.save()
            step.done(", ".join(f"{t} ({tier} tier)" for t, tier in TENANTS))

        with console.step("API, relays, indexers and the embedding provider") as step:
            client = self.start_services(step)
            step.done(f"API on {self.api_url}, 2 relays, one indexer pool per tier")
        return client

    def create_tenant(self, tenant_id: str, tier: str) -> dict[str, str]:
        """``tenant_id``, or ``tenant_id-<random>`` when a tenant of that name exists already
        (a database the demo ran against before, whose keys it no longer has)."""
        try:
            output = self.kb("tenants", "create", tenant_id, "--tier", tier)
        except RuntimeError:
            tenant_id = f"{tenant_id}-{uuid.uuid4().hex[:6]}"
            output = self.kb("tenants", "create", tenant_id, "--tier", tier)
        key = output.strip().removeprefix("KB_API_KEY=")
        return {"tier": tier, "key": key, "id": tenant_id}

    def start_services(self, step: Step) -> ApiClient:
        procs = self.processes
        if procs.running("api") is None:
            self.values["api_port"] = free_port(self.preferred_api_port)
        if procs.running("provider") is None:
            self.values["provider_port"] = free_port()
        procs.save()
        client = ApiClient(self.api_url)
        step.log = self.log("provider")
        port = str(self.values["provider_port"])
        procs.start("provider", ["kbtools.demo.provider", "--port", port], dict(self.env))
        step.until("the embedding provider", lambda: client.healthy(f"{self.provider_url}/healthz"))
        step.log = self.log("api")
        procs.start(
            "api", ["services.cli", "serve", "--port", str(self.values["api_port"])], self.env
        )
        relay_env = {**self.env, "KB_RELAY_TOPIC_TIERS": '["standard","premium"]'}
        for n in (1, 2):
            procs.start(f"relay-{n}", ["services.cli", "relay", "run"], relay_env)
        for _, tier in TENANTS:
            self.start_indexer(tier)
        step.until("the API", lambda: client.healthy(f"{self.api_url}/readyz"))
        return client

    def indexer_env(self) -> dict[str, str]:
        return {
            **self.env,
            # The indexers reach the model over HTTP, through the provider that can throttle;
            # the API embeds queries with the same model in-process.
            "KB_EMBEDDING_PROVIDER": "openai",
            "KB_EMBEDDING_BASE_URL": f"{self.provider_url}/v1",
            "KB_EMBEDDING_MODEL": MODEL,
            "KB_EMBEDDING_DIMENSIONS": "384",
            # Short timers so the story's retries and takeover happen in seconds.
            "KB_INDEXER_LEASE_SECONDS": "4",
            "KB_INDEXER_POLL_SECONDS": "1",
            "KB_INDEXER_BACKOFF_BASE_SECONDS": "1",
            "KB_INDEXER_BACKOFF_CAP_SECONDS": "2",
            "KB_INDEXER_GRACE_PERIOD_SECONDS": "5",
        }

    def start_indexer(self, tier: str) -> None:
        self.processes.start(
            f"indexer-{tier}",
            ["services.cli", "indexer", "run", "--tier", tier],
            self.indexer_env(),
        )
