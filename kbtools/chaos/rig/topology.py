"""The processes a chaos run starts and breaks: its own PostgreSQL (with one streaming
replica, which the API's searches and status reads use) and Kafka (it restarts them, so
never a shared server), the API, a second API that reads only the primary (the searches
that check a delete on the primary), two relays, two indexer processes per tier, one
ingest consumer per tier (each tenant's producer key registered) and the fault-injecting
embedding provider, each a real process started as a user starts it."""

from __future__ import annotations

import base64
import contextlib
import os
import signal
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kbtools.chaos.rig.ports import listen_port
from kbtools.chaos.rig.schedule import INDEXERS, INGESTERS, RELAYS
from kbtools.demo.client import Tenant
from kbtools.demo.processes import DemoProcesses
from kbtools.devstack.kafka import LocalKafka
from kbtools.devstack.postgres import EmbeddedPostgres
from kbtools.devstack.process import run_tool
from kbtools.devstack.replicas import EmbeddedReplica
from kbtools.devstack.settings import DevStackSettings
from services.publisher.ingest.signing import public_bytes

MODEL = "hashing-v1-384"
TIERS = ("standard", "premium")
# Two tenants share the standard tier, so its workers interleave tenants; one is premium.
TENANTS = (("acme", "standard"), ("initech", "standard"), ("globex", "premium"))
LEASE_SECONDS = 4
PRIMARY_API = "api-primary"  # a `kb serve` without KB_SEARCH_DATABASE_URLS
KEY_ID = "chaos"  # each tenant's producer key, as registered (traffic/ingest.py signs with it)
# KB_INGEST_MAX_INLINE_BYTES of the run's consumers: the run's documents are far below it,
# the too-large poison (traffic/poison.py) just above it (and below the broker's record limit).
MAX_INLINE_BYTES = 256 * 1024
# The checkout this module is in: the processes the run starts import this very tree.
SOURCE_ROOT = Path(__file__).resolve().parents[3]


def public_key_b64(key: Ed25519PrivateKey) -> str:
    return base64.b64encode(public_bytes(key)).decode()


class ChaosStack:
    def __init__(
        self,
        home: Path,
        *,
        pg_port: int | None,
        kafka_port: int | None,
        replica_port: int | None = None,
    ) -> None:
        self.home = home
        self.run_id = uuid.uuid4().hex[:8]
        # Every port below the ephemeral range: the run restarts these servers, and a
        # client connection must not take a port while its server is down (ports.py).
        taken = {p for p in (pg_port, kafka_port, replica_port) if p}
        kafka = kafka_port or listen_port(taken=taken)
        self.dev = DevStackSettings(
            home=home / "dev",
            pg_port=pg_port or listen_port(taken=taken),
            kafka_port=kafka,
            kafka_controller_port=int(os.environ.get("KB_DEV_KAFKA_CONTROLLER_PORT", 0))
            or listen_port(taken=taken),
            pg_database=f"chaos_{self.run_id}",
        )
        self.postgres = EmbeddedPostgres(self.dev)
        # Its own slot and data dir under the run's home; it follows the primary's restart
        # by itself (its WAL receiver reconnects), as a managed replica does.
        self.replica = EmbeddedReplica(self.dev, 1, port=replica_port or listen_port(taken=taken))
        self.kafka = LocalKafka(self.dev)
        self.processes = DemoProcesses(home / f"run-{self.run_id}")
        self.api_port = listen_port(taken=taken)
        self.primary_api_port = listen_port(taken=taken)
        self.provider_port = listen_port(taken=taken)
        self.topic_prefix = f"chaos-{self.run_id}."
        self.tenants: dict[str, Tenant] = {}
        self.ingest_keys = {tenant_id: Ed25519PrivateKey.generate() for tenant_id, _ in TENANTS}
        self.env: dict[str, str] = {}
        self.started_servers = False

    @property
    def database_url(self) -> str:
        return self.postgres.url

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    @property
    def primary_api_url(self) -> str:
        return f"http://127.0.0.1:{self.primary_api_port}"

    @property
    def provider_url(self) -> str:
        return f"http://127.0.0.1:{self.provider_port}"

    def log(self, name: str) -> Path:
        return self.processes.home / f"{name}.log"

    # --- set-up ---------------------------------------------------------------------------

    def up(self) -> None:
        # Servers already running (a previous `--keep` run) are left running afterwards.
        self.started_servers = not (self.postgres.status().running or self.kafka.status().running)
        self.postgres.up()
        # The replica's base backup and the broker's start (a JVM: the slowest) go on while
        # the schema and the tenants are written to the primary.
        with ThreadPoolExecutor(max_workers=2) as pool:
            servers = [pool.submit(self.replica.up), pool.submit(self.kafka.up)]
            self._prepare_database()
            for server in servers:
                server.result()
        self.start("provider")
        self.await_http(f"{self.provider_url}/healthz")
        for name in ("api", PRIMARY_API, *RELAYS, *INDEXERS, *INGESTERS):
            self.start(name)
        self.await_http(f"{self.api_url}/readyz")
        self.await_http(f"{self.primary_api_url}/readyz")
        for name in INGESTERS:  # its topics created: the load's first command has a home
            self.await_log(name, '"ingest.started"')

    def _prepare_database(self) -> None:
        base = {k: v for k, v in os.environ.items() if not k.startswith(("KB_", "DATABASE_U"))}
        self.env = {
            **base,
            "DATABASE_URL": self.database_url,
            "KAFKA_BOOTSTRAP_SERVERS": self.kafka.bootstrap,
            "KB_KAFKA_TOPIC_PREFIX": self.topic_prefix,
            "KB_LOG_FORMAT": "json",
            "KB_SEARCH_DATABASE_URLS": self.replica.url,
            # Everything embeds through the provider that fails on command, search included.
            "KB_EMBEDDING_PROVIDER": "openai",
            "KB_EMBEDDING_BASE_URL": f"{self.provider_url}/v1",
            "KB_EMBEDDING_MODEL": MODEL,
            "KB_EMBEDDING_DIMENSIONS": "384",
            "KB_EMBEDDING_TIMEOUT_SECONDS": "2",
            "KB_EMBEDDING_CONNECT_TIMEOUT_SECONDS": "1",
            "KB_EMBEDDING_BREAKER_OPEN_SECONDS": "3",
            "KB_EMBEDDING_BREAKER_MAX_OPEN_SECONDS": "6",
            "KB_EMBEDDING_BREAKER_PROBE_SECONDS": "5",
            "KB_RELAY_TOPIC_TIERS": '["standard","premium"]',
            "KB_RELAY_LEASE_SECONDS": "5",
            "KB_RELAY_SEND_TIMEOUT_SECONDS": "2",
            "KB_RELAY_BACKOFF_MAX_SECONDS": "2",
            # Short timers so takeovers and retries happen within a short run.
            "KB_INDEXER_LEASE_SECONDS": str(LEASE_SECONDS),
            "KB_INDEXER_POLL_SECONDS": "1",
            "KB_INDEXER_BACKOFF_BASE_SECONDS": "1",
            "KB_INDEXER_BACKOFF_CAP_SECONDS": "3",
            "KB_INDEXER_GRACE_PERIOD_SECONDS": "3",
            "KB_INDEXER_PARSE_WORKERS": "1",
            "KB_INGEST_BACKOFF_MAX_SECONDS": "2",
            "KB_INGEST_MAX_INLINE_BYTES": str(MAX_INLINE_BYTES),  # the too-large poison's
            "PYTHONPATH": str(SOURCE_ROOT),
        }
        self.kb("migrate")
        # One process each, side by side: a CLI's start is most of what it costs.
        with ThreadPoolExecutor(max_workers=len(TENANTS)) as pool:
            created = {
                (tenant_id, tier): pool.submit(self._create_tenant, tenant_id, tier)
                for tenant_id, tier in TENANTS
            }
        for (tenant_id, tier), output in created.items():
            key = output.result().strip().splitlines()[-1].removeprefix("KB_API_KEY=")
            self.tenants[tenant_id] = Tenant(tenant_id, tier, key)

    def _create_tenant(self, tenant_id: str, tier: str) -> str:
        """The tenant, then its producer's key for the ingest commands."""
        output = self.kb("tenants", "create", tenant_id, "--tier", tier)
        public_key = public_key_b64(self.ingest_keys[tenant_id])
        self.kb("tenants", "ingest-keys", "add", tenant_id, KEY_ID, "--public-key", public_key)
        return output

    def argv(self, name: str) -> list[str]:
        if name == "provider":
            port = str(self.provider_port)
            # A remote provider's latency keeps tasks in flight long enough to be struck.
            return [
                "kbtools.demo.provider", "--port", port, "--embedder", "hashing",
                "--latency", "0.3",
            ]  # fmt: skip
        if name == "api":
            return ["services.cli", "serve", "--port", str(self.api_port)]
        if name == PRIMARY_API:
            return ["services.cli", "serve", "--port", str(self.primary_api_port)]
        if name.startswith("relay-"):
            return ["services.cli", "relay", "run"]
        tier = name.split("-")[1]
        if name.startswith("ingest-"):
            return ["services.cli", "ingest", "run", "--tier", tier]
        return ["services.cli", "indexer", "run", "--tier", tier]

    def start(self, name: str) -> None:
        env = self.env
        if name == PRIMARY_API:
            env = {k: v for k, v in env.items() if k != "KB_SEARCH_DATABASE_URLS"}
        self.processes.start(name, self.argv(name), env)

    def kb(self, *args: str, timeout: float = 300) -> str:
        done = run_tool(
            [sys.executable, "-m", "services.cli", *args], env=self.env, timeout=timeout
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"kb {' '.join(args)} exited {done.returncode}: {done.stderr[-800:]}"
            )
        return done.stdout

    def kb_status(self, *args: str, timeout: float = 300) -> tuple[int, str]:
        done = run_tool(
            [sys.executable, "-m", "services.cli", *args], env=self.env, timeout=timeout
        )
        return done.returncode, done.stdout + done.stderr

    def await_http(self, url: str, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            time.sleep(0.3)
        raise RuntimeError(f"{url} did not answer 200 within {timeout_s:.0f}s")

    def await_log(self, name: str, needle: str, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            log = self.log(name)
            if log.exists() and needle in log.read_text(errors="replace"):
                return
            time.sleep(0.3)
        raise RuntimeError(f"{name} did not log {needle} within {timeout_s:.0f}s")

    # --- faults ---------------------------------------------------------------------------

    def pid(self, name: str) -> int | None:
        child = self.processes.running(name)
        return child.pid if child is not None else None

    def kill(self, name: str) -> None:
        self.processes.kill(name)

    def signal(self, name: str, signum: signal.Signals) -> None:
        pid = self.pid(name)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    def restart_postgres(self) -> None:
        self.postgres.down()
        self.postgres.up()

    def stop_kafka(self) -> None:
        self.kafka.down()

    def start_kafka(self) -> None:
        self.kafka.up()

    # --- tear-down ------------------------------------------------------------------------

    def stop_processes(self) -> None:
        for name in list(self.processes.state.children):
            self.signal(name, signal.SIGCONT)  # a stopped process cannot act on SIGTERM
        self.processes.stop_all(grace_s=10)

    def down(self) -> None:
        self.stop_processes()
        if not self.started_servers:
            return
        with contextlib.suppress(Exception):
            self.kafka.down()
        with contextlib.suppress(Exception):
            self.replica.down()
        with contextlib.suppress(Exception):
            self.postgres.down()
