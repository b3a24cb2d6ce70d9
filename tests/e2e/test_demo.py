"""`kb demo` end to end, as a new user runs it (here against the test's own database and
topic prefix), then `kb demo --stop`: the story's lines, the database it leaves, no process
left behind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from kbtools.devstack.process import pid_alive
from tests.support.api import free_port
from tests.support.stack import REPO_ROOT

pytestmark = pytest.mark.e2e

KB = [sys.executable, "-m", "services.cli"]


def kb(env: dict[str, str], *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*KB, *args], env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout
    )


async def test_kb_demo_tells_the_story_and_stops(
    service_env: dict[str, str], conn: asyncpg.Connection[Any], tmp_path: Path
) -> None:
    home = tmp_path / "demo"
    port = str(free_port())
    told = kb(service_env, "demo", "--home", str(home), "--port", port, timeout=900)
    state = json.loads((home / "state.json").read_text())
    pids = [child["pid"] for child in state["children"].values()]
    try:
        assert told.returncode == 0, told.stdout + told.stderr[-3000:]
        story = told.stdout
        for line in (
            "answered from v1 (30 days)",
            "EMBEDDING_RATE_LIMITED: RETRY_WAIT, document INDEXING, search still answers "
            "from v1 only",
            "SEARCHABLE on v2: search answers from v2 only (45 days)",
            "FAILED: DOCUMENT_PARSE_FAILED; search still serves v2",
            "group:sales sees nothing of it; globex's key on acme's path: 403",
            "taken over: SUCCEEDED on attempt 2",
            f"http://127.0.0.1:{port}/ui",
        ):
            assert line in story, story
        refund = story.split("refund policy  document ", 1)[1].split()[0]
        served = await conn.fetchval(
            "SELECT version_number FROM document_search_version WHERE document_id = $1::uuid",
            refund,
        )
        assert served == 2
        tasks = {
            row["version_number"]: row
            for row in await conn.fetch(
                "SELECT version_number, status, attempts, error_code FROM index_task "
                "WHERE document_id = $1::uuid",
                refund,
            )
        }
        assert tasks[1]["status"] == "SUCCEEDED"
        assert tasks[2]["status"] == "SUCCEEDED"
        assert tasks[2]["attempts"] >= 2  # the 429s cost attempts, then it went through
        assert tasks[3]["status"] == "DEAD"
        assert tasks[3]["error_code"] == "DOCUMENT_PARSE_FAILED"
        handbook = await conn.fetchrow(
            "SELECT t.status, t.attempts FROM index_task t JOIN document d USING "
            "(tenant_id, document_id) WHERE d.title = 'Field operations handbook'"
        )
        assert handbook is not None
        assert handbook["status"] == "SUCCEEDED"
        assert handbook["attempts"] >= 2
        assert all(pid_alive(pid) for pid in pids), "the services keep running after the demo"
    finally:
        stopped = kb(service_env, "demo", "--stop", "--home", str(home))
    assert stopped.returncode == 0, stopped.stderr
    assert not [pid for pid in pids if pid_alive(pid)], "kb demo --stop left processes behind"
