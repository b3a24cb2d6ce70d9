"""`kb serve` as a user runs it: create a tenant, upload, publish, crash, retry."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import asyncpg
import httpx
import pytest

from tests.support.api import free_port
from tests.support.stack import REPO_ROOT

pytestmark = pytest.mark.e2e

KB = [sys.executable, "-m", "services.cli"]


@contextmanager
def kb_serve(env: dict[str, str], port: int) -> Iterator[subprocess.Popen[str]]:
    process = subprocess.Popen(
        [*KB, "serve", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_ready(process, f"http://127.0.0.1:{port}")
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate(timeout=30)


def kb(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*KB, *args], env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )


def _wait_ready(process: subprocess.Popen[str], url: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            _, stderr = process.communicate()
            raise AssertionError(f"kb serve exited with {process.returncode}: {stderr}")
        try:
            if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError("kb serve did not become ready")


async def test_publish_through_kb_serve_survives_a_crash(
    service_env: dict[str, str], conn: asyncpg.Connection[Any]
) -> None:
    created = kb(service_env, "tenants", "create", "acme", "--tier", "standard")
    assert created.returncode == 0, created.stderr
    key = created.stdout.strip().removeprefix("KB_API_KEY=")
    headers = {"Authorization": f"Bearer {key}"}
    port = free_port()
    base = f"http://127.0.0.1:{port}/v1/tenants/acme"

    with kb_serve(service_env, port) as server:
        async with httpx.AsyncClient(timeout=10) as client:
            uploaded = await client.post(
                f"{base}/documents",
                files={"file": ("refunds.md", b"# Refunds\n\n30 days.", "text/markdown")},
                data={"title": "Refund policy"},
                headers=headers,
            )
            assert uploaded.status_code == 201, uploaded.text
            document_id = uploaded.json()["documentId"]
            publish_path = f"{base}/documents/{document_id}/versions/1/publish"
            body = {"revision": 1, "acl": {"read": ["group:support"]}}
            published = await client.post(publish_path, json=body, headers=headers)
            assert published.status_code == 202, published.text
            status = (await client.get(f"{base}/documents/{document_id}", headers=headers)).json()
            assert status["indexStatus"] == "INDEXING"
            assert status["indexTaskId"] == published.json()["indexTaskId"]
        # A crash, not a shutdown.
        os.kill(server.pid, signal.SIGKILL)
        server.wait(timeout=30)

    with kb_serve(service_env, port) as server:
        async with httpx.AsyncClient(timeout=10) as client:
            # The client never saw the answer and retries: same task, nothing added.
            retried = await client.post(publish_path, json=body, headers=headers)
            assert retried.status_code == 202, retried.text
            assert retried.json() == published.json()
            metrics = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
            assert 'kb_publisher_operations_total{operation="publish",result="unchanged"} 1.0' in (
                metrics
            )
        server.send_signal(signal.SIGTERM)
        _, stderr = server.communicate(timeout=30)
        # A graceful stop on SIGTERM is a success.
        assert server.returncode == 0, stderr
        assert "publisher.stopped" in stderr

    assert await conn.fetchval("SELECT count(*) FROM index_task") == 1
    assert [
        r["event_type"] for r in await conn.fetch("SELECT * FROM outbox ORDER BY position")
    ] == [
        "IndexTaskCreated",
        "DocumentVersionPublished",
    ]


UPLOAD_BYTES = 25_000_000  # just under the default limit of 25 MiB
PARALLEL_UPLOADS = 200
# The default budget (128 MiB) admits five such uploads at once; each costs ~2.5 times its
# size while it is stored, on top of ~100 MB of process (measured: ~390 MB peak).
RSS_BOUND_BYTES = 600 * 1024 * 1024


def _peak_rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc status")


async def test_parallel_large_uploads_stay_within_memory_and_are_201_or_503(
    service_env: dict[str, str], conn: asyncpg.Connection[Any]
) -> None:
    created = kb(service_env, "tenants", "create", "acme", "--tier", "standard")
    assert created.returncode == 0, created.stderr
    headers = {"Authorization": f"Bearer {created.stdout.strip().removeprefix('KB_API_KEY=')}"}
    content = b"refunds within thirty days. " * (UPLOAD_BYTES // 28)
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1/tenants/acme/documents"

    # One tenant's 200 uploads at once: its fair share (16 in flight by default) would refuse
    # most with 429 before they reach the process's upload budget, which is what this test
    # is about (the share has tests of its own: test_fair_share_api.py).
    env = {**service_env, "KB_FAIR_PUBLISH_CONCURRENCY": "0"}
    with kb_serve(env, port) as server:
        limits = httpx.Limits(max_connections=PARALLEL_UPLOADS, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:

            async def one(i: int) -> httpx.Response:
                return await client.post(
                    url,
                    files={"file": (f"policy-{i}.txt", content, "text/plain")},
                    data={"title": f"Policy {i}"},
                    headers=headers,
                )

            responses = await asyncio.gather(*(one(i) for i in range(PARALLEL_UPLOADS)))
        peak = _peak_rss_bytes(server.pid)

    statuses = Counter(r.status_code for r in responses)
    assert set(statuses) <= {201, 503}, statuses
    assert statuses[201] >= 1, statuses
    for response in responses:
        if response.status_code == 503:
            assert response.headers["content-type"] == "application/problem+json"
            assert int(response.headers["retry-after"]) >= 1
            assert response.json()["errorCode"] == "UPLOADS_BUSY"
    assert peak < RSS_BOUND_BYTES, f"peak RSS {peak / 2**20:.0f} MiB; answers {statuses}"
    print(f"peak RSS {peak / 2**20:.0f} MiB; answers {dict(statuses)}")

    # Nothing half-written: one whole version per accepted upload, nothing else.
    rows = await conn.fetch(
        "SELECT d.document_id, v.size_bytes, v.sha256 FROM document d"
        " JOIN document_version v USING (tenant_id, document_id)"
    )
    assert len(rows) == statuses[201] == await conn.fetchval("SELECT count(*) FROM document")
    digest = hashlib.sha256(content).digest()
    assert all(r["size_bytes"] == len(content) and r["sha256"] == digest for r in rows)
    assert {str(r["document_id"]) for r in rows} == {
        r.json()["documentId"] for r in responses if r.status_code == 201
    }
