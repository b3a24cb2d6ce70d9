"""No failure writes a secret, a frame's locals or an unbounded amount to the log (issue 41).

`kb serve` (tests/security/failing_server.py: the same process, with routes that fail on
purpose) runs at debug level over a real database and is made to fail every way we can
reach: a statement that fails (500) and one that is cancelled (503), both with the key in
the database's error message; an unhandled exception in a route; a background task whose
exception nobody retrieves; a Starlette background task failing after the answer; clients
that hang up in the middle of an upload; and a closed database pool under the key check
itself. Every byte the process wrote is then scanned for the key and its secret part, for
frame locals, and against the per-line and per-request bounds.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.runtime.log_safety import MAX_LINE_BYTES
from tests.e2e.test_searchable import wait_ready
from tests.support.api import ApiTenant, add_tenant, free_port
from tests.support.stack import REPO_ROOT

pytestmark = pytest.mark.integration

UPLOAD_BYTES = 2 * 1024 * 1024
UPLOAD_PATHS = ("/documents", "/documents/bulk")
HANG_UPS_PER_PATH = 2
HANG_UPS = HANG_UPS_PER_PATH * len(UPLOAD_PATHS)
# Generous: a loaded 2-core machine.
WAIT = 60.0
# What one failed request may write: its error line and, at most, one more of the server's.
PER_REQUEST_BYTES = 2 * MAX_LINE_BYTES


@contextmanager
def failing_server(env: dict[str, str], log: Path, port: int) -> Iterator[subprocess.Popen[bytes]]:
    """The server logging to ``log``; SIGTERM on the way out (uvicorn waits for requests and
    background tasks in flight, so everything they log is in ``log`` afterwards)."""
    command = [sys.executable, "-m", "tests.security.failing_server", "--port", str(port)]
    with log.open("wb") as out:
        process = subprocess.Popen(
            command, env=env, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


async def _fail_statements(conn: asyncpg.Connection[Any], key: str) -> None:
    """New documents fail (an error, 500) and publishing is cancelled (57014, 503): the
    database's error message quotes the key, as an error message may quote anything."""
    await conn.execute(
        f"""
        CREATE FUNCTION kb_test_fail() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            RAISE EXCEPTION 'injected failure for Authorization: Bearer {key} ({key})';
        END $$;
        CREATE TRIGGER kb_test_fail BEFORE INSERT ON document
            FOR EACH ROW EXECUTE FUNCTION kb_test_fail();
        CREATE FUNCTION kb_test_cancel() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            RAISE EXCEPTION 'injected cancel of credentials={key}' USING ERRCODE = '57014';
        END $$;
        CREATE TRIGGER kb_test_cancel BEFORE INSERT ON index_task
            FOR EACH ROW EXECUTE FUNCTION kb_test_cancel();
        """
    )


def _multipart_head(root: str, path: str, key: str, length: int, boundary: str) -> bytes:
    host = root.removeprefix("http://")
    return (
        f"POST {path} HTTP/1.1\r\n"
        f"Host: {host}\r\n"
        f"Authorization: Bearer {key}\r\n"
        f"Content-Type: multipart/form-data; boundary={boundary}\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


def _hang_up_mid_upload(root: str, tenant: ApiTenant, path: str) -> None:
    """A client sends the head and half of a large upload to ``path``, then closes the
    connection."""
    boundary = uuid.uuid4().hex
    part = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="title"\r\n\r\nHalf\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.txt"\r\n'
        "Content-Type: text/plain\r\n\r\n"
    ).encode()
    tail_part = f"\r\n--{boundary}--\r\n".encode()
    length = len(part) + UPLOAD_BYTES + len(tail_part)
    host, port = root.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(_multipart_head(root, tenant.path(path), tenant.key, length, boundary) + part)
        sock.sendall(b"x" * (UPLOAD_BYTES // 2))


async def _uploads_answered(client: httpx.AsyncClient) -> int:
    """How many uploads the server has finished with (answered, or given up on)."""
    text = (await client.get("/metrics")).text
    return sum(
        int(sample.value)
        for family in text_string_to_metric_families(text)
        if family.name == "kb_http_requests"
        for sample in family.samples
        if sample.name == "kb_http_requests_total"
        and sample.labels["method"] == "POST"
        and sample.labels["route"].endswith(UPLOAD_PATHS)
    )


async def _bulk_answers_by_status(client: httpx.AsyncClient) -> dict[str, int]:
    text = (await client.get("/metrics")).text
    return {
        sample.labels["status"]: int(sample.value)
        for family in text_string_to_metric_families(text)
        if family.name == "kb_http_requests"
        for sample in family.samples
        if sample.name == "kb_http_requests_total" and sample.labels["route"].endswith("/bulk")
    }


async def _until_uploads_answered(client: httpx.AsyncClient, count: int) -> None:
    """Another process's progress: polling its metrics is the only signal there is."""
    async with asyncio.timeout(WAIT):
        while True:
            if await _uploads_answered(client) >= count:
                return
            await asyncio.sleep(0.05)


async def _provoke(root: str, tenant: ApiTenant, conn: asyncpg.Connection[Any]) -> int:
    """Every failure, in turn; how many requests were made to fail."""
    failed = 0
    # uvicorn closes the connection of a request whose app raised: no reuse, no race.
    fresh = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(
        base_url=root, headers=tenant.headers, timeout=60, limits=fresh
    ) as client:
        files = {"file": ("a.txt", b"draft", "text/plain")}
        draft = await client.post(tenant.path("/documents"), files=files, data={"title": "D"})
        assert draft.status_code == 201, draft.text
        await _fail_statements(conn, tenant.key)

        created = await client.post(tenant.path("/documents"), files=files, data={"title": "E"})
        assert (created.status_code, created.json()["errorCode"]) == (500, "DATABASE_ERROR")
        document = tenant.path(f"/documents/{draft.json()['documentId']}")
        body = {"revision": draft.json()["revision"], "acl": {"read": ["group:all"]}}
        published = await client.post(f"{document}/versions/1/publish", json=body)
        assert (published.status_code, published.json()["errorCode"]) == (503, "DATABASE_BUSY")
        raised = await client.get(tenant.path("/test-only/raise"))
        assert (raised.status_code, raised.json()["errorCode"]) == (500, "INTERNAL_ERROR")
        failed += 3
        for path in ("/test-only/task", "/test-only/after-response"):
            answered = await client.get(tenant.path(path))
            assert answered.status_code == 200, answered.text
            failed += 1

        # One upload route has FastAPI read the form (a hang-up is its 400), the other reads
        # it itself (a hang-up is an unhandled ClientDisconnect).
        for path in UPLOAD_PATHS:
            for _ in range(HANG_UPS_PER_PATH):
                await asyncio.to_thread(_hang_up_mid_upload, root, tenant, path)
                failed += 1
        # The server notices a hang-up on its own time: the pool must not be closed under
        # the key check of an upload it has not got to yet.
        await _until_uploads_answered(client, 2 + HANG_UPS)
        # A hang-up is the client's doing: no upload route counts it as the server failing.
        assert await _bulk_answers_by_status(client) == {"400": HANG_UPS_PER_PATH}

        closed = await client.post(tenant.path("/test-only/close-pool"))
        assert closed.status_code == 200, closed.text
        for _ in range(2):
            refused = await client.get(document)
            assert refused.status_code >= 500, refused.text
            failed += 1
    return failed


def _frames_with_locals(value: Any) -> int:
    if isinstance(value, dict):
        own = 1 if "locals" in value else 0
        return own + sum(_frames_with_locals(v) for v in value.values())
    if isinstance(value, list):
        return sum(_frames_with_locals(v) for v in value)
    return 0


async def test_failures_log_no_key_no_locals_and_a_bounded_amount(
    service_env: dict[str, str], conn: asyncpg.Connection[Any], tmp_path: Path
) -> None:
    tenant = await add_tenant(conn, "acme")
    env = {**service_env, "KB_LOG_LEVEL": "debug", "KB_LOG_FORMAT": "json"}
    port = free_port()
    root = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    with failing_server(env, log, port) as process:
        await wait_ready(root, process, log)
        started_at = log.stat().st_size
        failed = await _provoke(root, tenant, conn)
    assert process.returncode == 0, "the server did not stop gracefully"

    problems = _problems(log.read_bytes(), started_at, failed, tenant.key)
    assert not problems, "\n".join(problems)


def _problems(data: bytes, started_at: int, failed: int, key: str) -> list[str]:
    """What is wrong with the log ``data`` of ``failed`` failed requests made after byte
    ``started_at``: each problem once, all of them."""
    text = data.decode(errors="replace")
    lines = text.splitlines()
    problems = []
    secret_part = key.rsplit(".", 1)[-1]
    for name, secret in (("the key", key), ("its secret part", secret_part)):
        leaks = [line[:300] for line in lines if secret in line]
        if leaks:
            problems.append(f"{name} in {len(leaks)} log lines, e.g. {leaks[0]}")
    entries = [json.loads(line) for line in lines]  # every line one JSON object
    with_locals = sum(_frames_with_locals(e) for e in entries)
    if with_locals or "HTTPAuthorizationCredentials" in text:
        problems.append(f"frame locals logged ({with_locals} frames)")
    longest = max(len(line.encode()) for line in lines)
    if longest > MAX_LINE_BYTES:
        problems.append(f"a line of {longest} bytes (at most {MAX_LINE_BYTES})")
    written = len(data) - started_at
    if written > failed * PER_REQUEST_BYTES:
        problems.append(f"{written} bytes for {failed} failed requests")

    # Each hang-up is one short line, not an error with a traceback.
    hang_ups = [e for e in entries if e["event"] == "request.client_disconnected"]
    if len(hang_ups) != HANG_UPS or any(e["level"] != "info" for e in hang_ups):
        problems.append(f"{HANG_UPS} hang-ups logged as: {hang_ups}")
    if "ClientDisconnect" in text:
        problems.append("a hang-up logged as an error")
    # Logged once, by the app: not again by the server.
    if "Exception in ASGI application" in text:
        problems.append("an exception logged twice")
    # Every failure was logged (redacted, not dropped): the raise, the task, the background.
    if sum("InjectedFailure" in line for line in lines) < 3:
        problems.append(f"a failure not logged: {[e['event'] for e in entries]}")
    return problems
