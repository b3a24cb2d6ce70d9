"""From published to searchable, as a user runs it: `kb serve`, `kb relay run` and
`kb indexer run` (the default local ONNX model) as processes; a Markdown refund policy
uploaded and published through the HTTP API becomes SEARCHABLE; a corrupt PDF v2 ends
FAILED with DOCUMENT_PARSE_FAILED while v1 stays the search version."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from tests.support.api import free_port
from tests.support.stack import REPO_ROOT

pytestmark = pytest.mark.e2e

KB = [sys.executable, "-m", "services.cli"]
# Bounded: the model loads and indexes a small document in seconds even on 2 busy cores.
INDEXED_WITHIN = 180.0
STARTED_WITHIN = 180.0
MODEL = "all-MiniLM-L6-v2-onnx-int8"

REFUND_POLICY = b"""# Refund policy

## Window

Customers may return any item within 30 days of delivery for a full refund.

## Exceptions

Gift cards and opened software are not refundable.

## How to ask

Write to support with the order number; refunds reach the card within 5 business days.
"""


def tail(log: Path) -> str:
    return log.read_text()[-3000:]


def kb(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*KB, *args], env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )


def stop(process: subprocess.Popen[bytes]) -> int:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise


@contextmanager
def started(env: dict[str, str], log: Path, *args: str) -> Iterator[subprocess.Popen[bytes]]:
    """A `kb` process logging to a file; SIGTERM on the way out, and then, unless the test
    already failed, it must exit 0 (a graceful stop)."""
    with log.open("wb") as out:
        process = subprocess.Popen(
            [*KB, *args], env=env, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        yield process
    except BaseException:
        stop(process)
        raise
    code = stop(process)
    assert code == 0, f"{args[0]} exited {code}: {tail(log)}"


Watched = list[tuple[subprocess.Popen[bytes], Path]]


def pipeline_services(
    services: ExitStack, env: dict[str, str], logs_in: Path, port: int
) -> tuple[dict[str, Path], Watched]:
    """`kb serve` on ``port``, `kb relay run` and `kb indexer run`, started in ``services``:
    their logs by name, and each process with its log (the serve first)."""
    logs = {name: logs_in / f"{name}.log" for name in ("serve", "relay", "indexer")}
    server = services.enter_context(
        started(env, logs["serve"], "serve", "--host", "127.0.0.1", "--port", str(port))
    )
    relay = services.enter_context(started(env, logs["relay"], "relay", "run"))
    indexer = services.enter_context(
        started(env, logs["indexer"], "indexer", "run", "--tier", "standard")
    )
    return logs, [(server, logs["serve"]), (relay, logs["relay"]), (indexer, logs["indexer"])]


async def wait_ready(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    # Generous: on a loaded 2-core runner importing the app alone can take a minute.
    async with asyncio.timeout(STARTED_WITHIN), httpx.AsyncClient(timeout=2) as client:
        while True:
            assert process.poll() is None, f"kb serve exited: {tail(log)}"
            try:
                if (await client.get(f"{url}/readyz")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            # Another process: polling is the only signal there is.
            await asyncio.sleep(0.1)


async def wait_for_status(
    client: httpx.AsyncClient, path: str, wanted: str, processes: list[Any]
) -> dict[str, Any]:
    async with asyncio.timeout(INDEXED_WITHIN):
        while True:
            for process, log in processes:
                assert process.poll() is None, f"a service exited: {tail(log)}"
            answer = await client.get(path)
            assert answer.status_code == 200, answer.text
            body: dict[str, Any] = answer.json()
            if body["indexStatus"] == wanted:
                return body
            await asyncio.sleep(0.2)


async def top_hit(client: httpx.AsyncClient, base: str) -> tuple[str, int]:
    found = await client.post(
        f"{base}/search",
        json={
            "query": "how many days do I have to return an item?",
            "topK": 3,
            "principals": ["group:all"],
        },
    )
    assert found.status_code == 200, found.text
    best = found.json()["results"][0]
    return best["documentId"], best["versionNumber"]


async def test_a_published_policy_becomes_searchable_and_a_corrupt_v2_fails_visibly(
    service_env: dict[str, str], conn: asyncpg.Connection[Any], tmp_path: Path
) -> None:
    env = {**service_env, "KB_INDEXER_POLL_SECONDS": "0.5", "KB_LOG_FORMAT": "json"}
    created = kb(env, "tenants", "create", "acme", "--tier", "standard")
    assert created.returncode == 0, created.stderr
    key = created.stdout.strip().removeprefix("KB_API_KEY=")
    port = free_port()
    root = f"http://127.0.0.1:{port}"
    base = "/v1/tenants/acme"

    with ExitStack() as services:
        logs, watched = pipeline_services(services, env, tmp_path, port)
        await wait_ready(root, *watched[0])

        headers = {"Authorization": f"Bearer {key}"}
        async with httpx.AsyncClient(base_url=root, headers=headers, timeout=10) as client:
            uploaded = await client.post(
                f"{base}/documents",
                files={"file": ("refunds.md", REFUND_POLICY, "text/markdown")},
                data={"title": "Refund policy"},
            )
            assert uploaded.status_code == 201, uploaded.text
            document_id = uuid.UUID(uploaded.json()["documentId"])
            document = f"{base}/documents/{document_id}"
            published = await client.post(
                f"{document}/versions/1/publish",
                json={"revision": uploaded.json()["revision"], "acl": {"read": ["group:all"]}},
            )
            assert published.status_code == 202, published.text

            searchable = await wait_for_status(client, document, "SEARCHABLE", watched)
            assert (searchable["searchVersion"], searchable["failure"]) == (1, None)

            chunks = await conn.fetch(
                "SELECT version_number, embedding_model, vector_dims(embedding) AS dims, text"
                "  FROM knowledge_chunk WHERE tenant_id = 'acme' AND document_id = $1",
                document_id,
            )
            assert chunks
            assert {(c["version_number"], c["embedding_model"], c["dims"]) for c in chunks} == {
                (1, MODEL, 384)
            }
            assert any("30 days" in c["text"] for c in chunks)
            assert await top_hit(client, base) == (str(document_id), 1)

            v2 = await client.post(
                f"{document}/versions",
                files={"file": ("refunds.pdf", b"%PDF-1.7\n1 0 obj <<", "application/pdf")},
            )
            assert v2.status_code == 201, v2.text
            published = await client.post(
                f"{document}/versions/2/publish",
                json={"revision": v2.json()["revision"], "acl": {"read": ["group:all"]}},
            )
            assert published.status_code == 202, published.text

            failed = await wait_for_status(client, document, "FAILED", watched)
            assert failed["failure"]["errorCode"] == "DOCUMENT_PARSE_FAILED"
            assert (failed["publishedVersion"], failed["searchVersion"]) == (2, 1)
            task = await client.get(f"{base}/index-tasks/{published.json()['indexTaskId']}")
            assert (task.json()["status"], task.json()["errorCode"]) == (
                "DEAD",
                "DOCUMENT_PARSE_FAILED",
            )
            # Search still answers from v1.
            assert await top_hit(client, base) == (str(document_id), 1)
        # v1's chunks are untouched; nothing of v2 was written.
        versions = await conn.fetch(
            "SELECT DISTINCT version_number FROM knowledge_chunk WHERE document_id = $1",
            document_id,
        )
        assert [v["version_number"] for v in versions] == [1]
    # Leaving the ExitStack sent SIGTERM to each service and checked it exited 0.
    assert '"event": "pipeline.embedded"' in logs["indexer"].read_text()
