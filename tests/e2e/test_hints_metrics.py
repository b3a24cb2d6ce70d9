"""Kafka hints and the metrics, as a user runs the services: with the indexer's poll timer at
60 s, a published document is indexed in seconds only because the relay's hint woke the
indexer; every process's /metrics moves with the work and no label carries an id."""

from __future__ import annotations

import asyncio
import re
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from kbtools.devstack.kafka import LocalKafka
from kbtools.devstack.settings import DevStackSettings
from tests.e2e.test_searchable import kb, started, wait_ready
from tests.support.api import free_port

pytestmark = pytest.mark.e2e

# Only a hint explains indexing within this bound: the idle poll waits 30-60 s.
HINTED_WITHIN = 25.0
_SAMPLE = re.compile(r"^(?P<name>[a-z_]+)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$")
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    found = []
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match["labels"] or ""))
        found.append((match["name"], labels, float(match["value"])))
    return found


def value(text: str, name: str, **labels: str) -> float:
    return sum(
        v
        for n, got, v in samples(text)
        if n == name and all(got.get(k) == w for k, w in labels.items())
    )


async def scrape(client: httpx.AsyncClient, url: str) -> str:
    answer = await client.get(url)
    assert answer.status_code == 200, answer.text
    return answer.text


async def until(client: httpx.AsyncClient, url: str, check: Any, what: str) -> str:
    # Generous: a broker restart and the group's rejoin take tens of seconds on 2 cores.
    async with asyncio.timeout(120):
        while True:
            try:
                text = await scrape(client, url)
            except httpx.TransportError:
                text = ""
            if text and check(text):
                return text
            await asyncio.sleep(0.2)  # another process: polling is the only signal there is


async def publish_notice(client: httpx.AsyncClient, base: str, headers: dict[str, str]) -> str:
    """Upload and publish a one-paragraph document; its id."""
    uploaded = await client.post(
        f"{base}/documents",
        files={"file": ("notice.md", b"# Notice\n\nThe depot opens at 7.", "text/markdown")},
        data={"title": "Notice"},
        headers=headers,
    )
    assert uploaded.status_code == 201, uploaded.text
    document: str = uploaded.json()["documentId"]
    published = await client.post(
        f"{base}/documents/{document}/versions/1/publish",
        json={"revision": 1, "acl": {"read": ["group:all"]}},
        headers=headers,
    )
    assert published.status_code == 202, published.text
    return document


async def searchable_within(
    client: httpx.AsyncClient, base: str, headers: dict[str, str], document: str, seconds: float
) -> None:
    async with asyncio.timeout(seconds):
        while True:
            status = await client.get(f"{base}/documents/{document}", headers=headers)
            if status.json()["indexStatus"] == "SEARCHABLE":
                return
            await asyncio.sleep(0.1)  # another process: polling is the only signal there is


async def test_a_hint_wakes_the_indexer_and_every_metrics_endpoint_moves(
    service_env: dict[str, str], tmp_path: Path
) -> None:
    env = {**service_env, "KB_EMBEDDING_PROVIDER": "hashing", "KB_LOG_FORMAT": "json"}
    created = kb(env, "tenants", "create", "acme", "--tier", "standard")
    assert created.returncode == 0, created.stderr
    headers = {"Authorization": f"Bearer {created.stdout.strip().removeprefix('KB_API_KEY=')}"}
    api_port, relay_port, indexer_port = free_port(), free_port(), free_port()
    api = f"http://127.0.0.1:{api_port}"
    relay_metrics = f"http://127.0.0.1:{relay_port}/metrics"
    indexer_metrics = f"http://127.0.0.1:{indexer_port}/metrics"
    indexer_env = {
        **env,
        "KB_INDEXER_POLL_SECONDS": "60",
        "KB_INDEXER_IDLE_BACKOFF_MIN_SECONDS": "60",
        "KB_INDEXER_METRICS_INTERVAL_SECONDS": "0.5",
    }
    with ExitStack() as services:
        server = services.enter_context(
            started(env, tmp_path / "api.log", "serve", "--port", str(api_port))
        )
        services.enter_context(
            started(env, tmp_path / "relay.log", "relay", "run", "--metrics-port", str(relay_port))
        )
        services.enter_context(
            started(
                indexer_env,
                tmp_path / "indexer.log",
                "indexer",
                "run",
                "--tier",
                "standard",
                "--metrics-port",
                str(indexer_port),
            )
        )
        await wait_ready(api, server, tmp_path / "api.log")
        async with httpx.AsyncClient(timeout=10) as client:
            # The hint consumer joined its group (partitions assigned) before we publish.
            await until(
                client,
                indexer_metrics,
                lambda t: value(t, "kb_indexer_hints_connected", tier="standard") == 1,
                "the hint consumer to connect",
            )
            base = f"{api}/v1/tenants/acme"
            document = await publish_notice(client, base, headers)
            await searchable_within(client, base, headers, document, HINTED_WITHIN)

            indexed = await until(
                client,
                indexer_metrics,
                lambda t: value(t, "kb_indexer_publish_to_searchable_seconds_count") >= 1,
                "publish->searchable to be observed",
            )
            assert value(indexed, "kb_indexer_hint_wakeups_total", tier="standard") >= 1
            assert value(indexed, "kb_indexer_hints_received_total", tier="standard") >= 1
            assert (
                value(indexed, "kb_indexer_task_results_total", tier="standard", result="succeeded")
                == 1
            )
            assert value(indexed, "kb_indexer_tasks_claimed_total", tier="standard") == 1
            assert value(indexed, "kb_indexer_stage_seconds_count", stage="embed") == 1
            assert value(indexed, "kb_indexer_tasks_due", tier="standard") == 0
            relayed = await until(
                client,
                relay_metrics,
                lambda t: (
                    value(t, "kb_relay_events_sent_total") >= 3
                ),  # created, published, switched
                "the relay to send the events",
            )
            served = await scrape(client, f"{api}/metrics")
            assert any(n == "kb_search_version_lagging_documents" for n, _, _ in samples(served))
            assert value(served, "kb_publisher_operations_total", operation="publish") >= 1

        for text in (indexed, relayed, served):
            for name, labels, _ in samples(text):
                for label in labels.values():
                    assert not _UUID.search(label), f"{name} carries an id: {labels}"
                    assert label not in ("acme", document), f"{name} carries an id: {labels}"


async def test_with_kafka_unreachable_the_indexer_works_by_polling_and_says_so(
    service_env: dict[str, str], tmp_path: Path
) -> None:
    env = {**service_env, "KB_EMBEDDING_PROVIDER": "hashing", "KB_LOG_FORMAT": "json"}
    created = kb(env, "tenants", "create", "acme", "--tier", "standard")
    assert created.returncode == 0, created.stderr
    headers = {"Authorization": f"Bearer {created.stdout.strip().removeprefix('KB_API_KEY=')}"}
    api_port, indexer_port = free_port(), free_port()
    api = f"http://127.0.0.1:{api_port}"
    indexer_metrics = f"http://127.0.0.1:{indexer_port}/metrics"
    # Nothing listens there: the indexer's Kafka is down from the start.
    indexer_env = {
        **env,
        "KAFKA_BOOTSTRAP_SERVERS": f"127.0.0.1:{free_port()}",
        "KB_INDEXER_POLL_SECONDS": "0.5",
    }
    log = tmp_path / "indexer.log"
    with ExitStack() as services:
        server = services.enter_context(
            started(env, tmp_path / "api.log", "serve", "--port", str(api_port))
        )
        services.enter_context(
            started(
                indexer_env,
                log,
                "indexer",
                "run",
                "--tier",
                "standard",
                "--metrics-port",
                str(indexer_port),
            )
        )
        await wait_ready(api, server, tmp_path / "api.log")
        async with httpx.AsyncClient(timeout=10) as client:
            base = f"{api}/v1/tenants/acme"
            document = await publish_notice(client, base, headers)
            await searchable_within(client, base, headers, document, 60)
            text = await scrape(client, indexer_metrics)
        assert value(text, "kb_indexer_hints_connected", tier="standard") == 0
        assert value(text, "kb_indexer_task_results_total", result="succeeded") == 1
    outages = [line for line in log.read_text().splitlines() if '"hints.unavailable"' in line]
    assert outages, "the outage is logged"
    assert len(outages) < 5, "logged once per outage, not once per retry"


async def test_hints_resume_after_kafka_restarts_without_restarting_the_indexer(
    service_env: dict[str, str], tmp_path: Path
) -> None:
    """A Kafka of this test's own, stopped and started again under a running indexer whose
    poll timer is 60 s: the gauge says hints are off while it is down, and once it is back a
    published document is indexed in seconds, so hints resumed by themselves."""
    kafka = LocalKafka(
        DevStackSettings(
            home=tmp_path / "dev", kafka_port=free_port(), kafka_controller_port=free_port()
        )
    )
    # LocalKafka is synchronous (it runs an event loop of its own to wait for the broker).
    bootstrap = (await asyncio.to_thread(kafka.up)).url
    assert bootstrap is not None
    try:
        env = {
            **service_env,
            "KAFKA_BOOTSTRAP_SERVERS": bootstrap,
            "KB_EMBEDDING_PROVIDER": "hashing",
            "KB_LOG_FORMAT": "json",
        }
        created = kb(env, "tenants", "create", "acme", "--tier", "standard")
        assert created.returncode == 0, created.stderr
        headers = {"Authorization": f"Bearer {created.stdout.strip().removeprefix('KB_API_KEY=')}"}
        api_port, indexer_port = free_port(), free_port()
        api = f"http://127.0.0.1:{api_port}"
        indexer_metrics = f"http://127.0.0.1:{indexer_port}/metrics"
        indexer_env = {
            **env,
            "KB_INDEXER_POLL_SECONDS": "60",
            "KB_INDEXER_IDLE_BACKOFF_MIN_SECONDS": "60",
        }
        with ExitStack() as services:
            server = services.enter_context(
                started(env, tmp_path / "api.log", "serve", "--port", str(api_port))
            )
            services.enter_context(started(env, tmp_path / "relay.log", "relay", "run"))
            services.enter_context(
                started(
                    indexer_env,
                    tmp_path / "indexer.log",
                    "indexer",
                    "run",
                    "--tier",
                    "standard",
                    "--metrics-port",
                    str(indexer_port),
                )
            )
            await wait_ready(api, server, tmp_path / "api.log")
            async with httpx.AsyncClient(timeout=10) as client:
                connected = "kb_indexer_hints_connected"
                await until(
                    client, indexer_metrics, lambda t: value(t, connected) == 1, "connected"
                )
                await asyncio.to_thread(kafka.down)
                await until(client, indexer_metrics, lambda t: value(t, connected) == 0, "off")
                assert (await asyncio.to_thread(kafka.up)).running
                await until(client, indexer_metrics, lambda t: value(t, connected) == 1, "back")
                base = f"{api}/v1/tenants/acme"
                document = await publish_notice(client, base, headers)
                await searchable_within(client, base, headers, document, HINTED_WITHIN)
    finally:
        await asyncio.to_thread(kafka.down)
