"""`kb indexer` and `kb tasks` as an operator runs them; a worker killed with SIGKILL
mid-task as a crash would; SIGTERM as an orchestrator sends it."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from services.runtime.heap import YOUNG_COLLECTION_THRESHOLD
from tests.support.stack import REPO_ROOT
from tests.support.tasks import create_task

pytestmark = pytest.mark.e2e

KB = [sys.executable, "-m", "services.cli"]
WAIT = 60.0


async def kb(env: dict[str, str], *args: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        *KB,
        *args,
        env=env,
        cwd=REPO_ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(WAIT):
        out, err = await process.communicate()
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


class Worker:
    """A `kb indexer run` process whose log lines (stderr, JSON) the test can wait for."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.lines: list[str] = []

    async def wait_for(self, event: str) -> dict[str, Any]:
        assert self.process.stderr is not None
        async with asyncio.timeout(WAIT):
            while True:
                raw = await self.process.stderr.readline()
                if not raw:
                    raise AssertionError(f"worker exited before {event}: {self.lines[-20:]}")
                line = raw.decode()
                self.lines.append(line)
                if f'"event": "{event}"' in line:
                    parsed: dict[str, Any] = json.loads(line)
                    return parsed

    async def drain(self) -> None:
        assert self.process.stderr is not None
        self.lines += (await self.process.stderr.read()).decode().splitlines()

    async def exit_code(self) -> int:
        """Waits for the process to end, reading its log meanwhile: a child whose stderr
        pipe is full blocks on its next log line and never exits."""
        assert self.process.stderr is not None
        stderr = self.process.stderr

        async def read_to_end() -> None:
            while raw := await stderr.readline():
                self.lines.append(raw.decode())

        try:
            async with asyncio.timeout(WAIT):
                _, code = await asyncio.gather(read_to_end(), self.process.wait())
        except TimeoutError:
            raise AssertionError(f"still running after {WAIT} s: {self.lines[-20:]}") from None
        return code


@pytest.fixture
async def start_worker(service_env: dict[str, str]) -> AsyncIterator[Any]:
    started: list[Worker] = []

    async def start(*, hang_generations: int | None = None, **env: str) -> Worker:
        # A hanging worker is `kb indexer run` wrapped by a test-only entry point.
        command = (
            [*KB, "indexer", "run"]
            if hang_generations is None
            else [sys.executable, "-m", "tests.support.hanging_worker"]
        )
        if hang_generations is not None:
            env["KB_TEST_ONLY_HANG_GENERATIONS"] = str(hang_generations)
        process = await asyncio.create_subprocess_exec(
            *command,
            "--tier",
            "standard",
            "--concurrency",
            "1",
            env={**service_env, **env},
            cwd=REPO_ROOT,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        worker = Worker(process)
        started.append(worker)
        return worker

    try:
        yield start
    finally:
        for worker in started:
            if worker.process.returncode is None:
                worker.process.kill()
                await worker.process.wait()
            # Read to the end: the pipe (and the process transport) is then closed, not left
            # for the garbage collector to warn about.
            await worker.drain()


async def test_run_once_prints_one_result_word(
    service_env: dict[str, str], pool: asyncpg.Pool[Any]
) -> None:
    good = await create_task(pool)
    code, out, err = await kb(service_env, "indexer", "run-once", "--tier", "standard")
    assert (code, out) == (0, "SUCCEEDED\n"), err
    await create_task(pool, media_type="application/x-unknown")
    code, out, _ = await kb(service_env, "indexer", "run-once", "--tier", "standard")
    assert (code, out) == (0, "FAILED\n")
    code, out, _ = await kb(service_env, "indexer", "run-once", "--tier", "standard")
    assert (code, out) == (0, "IDLE\n")
    assert (
        await pool.fetchval("SELECT status FROM index_task WHERE task_id = $1", good.task_id)
        == "SUCCEEDED"
    )
    code, _, err = await kb(service_env, "indexer", "run-once", "--tier", "Not A Tier")
    assert code == 2
    assert "tier" in err


async def test_operator_lists_shows_and_requeues_a_dead_task(
    service_env: dict[str, str], pool: asyncpg.Pool[Any]
) -> None:
    corrupt = await create_task(pool, stored_size=1)
    pending = await create_task(pool, tenant_id="globex")
    await pool.execute(
        "UPDATE index_task SET next_attempt_at = now() + interval '1 hour' WHERE task_id = $1",
        pending.task_id,
    )
    code, out, _ = await kb(service_env, "indexer", "run-once", "--tier", "standard")
    assert out == "FAILED\n"

    code, out, _ = await kb(service_env, "tasks", "list", "--status", "dead")
    assert code == 0
    assert str(corrupt.task_id) in out
    assert "DOCUMENT_PARSE_FAILED" in out
    assert str(pending.task_id) not in out
    code, out, _ = await kb(service_env, "tasks", "list", "--tenant", "globex")
    assert [line.split()[0] for line in out.splitlines()] == [str(pending.task_id)]

    code, out, _ = await kb(service_env, "tasks", "show", str(corrupt.task_id))
    shown = json.loads(out)
    assert (shown["status"], shown["error_code"], shown["requeues"]) == (
        "DEAD",
        "DOCUMENT_PARSE_FAILED",
        [],
    )

    code, out, err = await kb(
        service_env, "tasks", "requeue", str(corrupt.task_id), "--by", "ops@acme"
    )
    assert code == 0, err
    record = json.loads(out)
    assert (record["requeued_by"], record["reset_attempts"]) == ("ops@acme", False)
    code, out, _ = await kb(service_env, "tasks", "show", str(corrupt.task_id))
    shown = json.loads(out)
    assert shown["status"] == "PENDING"
    assert shown["requeues"][0]["previous_error_code"] == "DOCUMENT_PARSE_FAILED"

    for args, message in [
        (("tasks", "show", "not-a-uuid"), "not a task id"),
        (("tasks", "show", str(uuid.uuid4())), "no index task"),
        (("tasks", "list", "--status", "FINISHED"), "unknown status"),
        (("tasks", "requeue", str(pending.task_id)), "only DEAD"),
    ]:
        code, _, err = await kb(service_env, *args)
        assert code == 2, (args, err)
        assert message in err
        assert "Traceback" not in err


async def test_a_worker_killed_mid_task_is_taken_over_after_its_lease(
    start_worker: Any, pool: asyncpg.Pool[Any]
) -> None:
    created = await create_task(pool)
    crash_env = {
        "KB_INDEXER_LEASE_SECONDS": "2",
        "KB_INDEXER_POLL_SECONDS": "0.2",
        "KB_EMBEDDING_PROVIDER": "hashing",
    }
    # Generation 1 hangs; later ones really run.
    doomed = await start_worker(hang_generations=1, **crash_env)
    claimed = await doomed.wait_for("task.claimed")
    assert claimed["task_id"] == str(created.task_id)
    assert claimed["lease_attempt"] == 1
    doomed.process.send_signal(signal.SIGKILL)
    assert await doomed.process.wait() == -signal.SIGKILL
    await doomed.drain()
    row = await pool.fetchrow(
        "SELECT status, attempts FROM index_task WHERE task_id = $1", created.task_id
    )
    assert row is not None
    assert (row["status"], row["attempts"]) == ("RUNNING", 1)  # stuck only until the lease ends

    successor = await start_worker(hang_generations=1, **crash_env)
    taken = await successor.wait_for("task.claimed")
    assert (taken["task_id"], taken["lease_attempt"]) == (str(created.task_id), 2)
    await successor.wait_for("task.completed")
    row = await pool.fetchrow(
        "SELECT status, attempts, lease_owner FROM index_task WHERE task_id = $1",
        created.task_id,
    )
    assert row is not None
    assert (row["status"], row["attempts"]) == ("SUCCEEDED", 2)
    assert row["lease_owner"] == taken["owner"] != claimed["owner"]
    assert (
        await pool.fetchval(
            "SELECT count(*) FROM index_task WHERE status NOT IN ('SUCCEEDED', 'DEAD')"
        )
        == 0
    )

    successor.process.send_signal(signal.SIGTERM)
    assert await successor.exit_code() == 0
    assert any('"event": "worker.stopped"' in line for line in successor.lines)


async def test_the_start_up_heap_is_frozen_before_the_first_claim(
    start_worker: Any, pool: asyncpg.Pool[Any]
) -> None:
    # The collector's full passes then skip what start-up made (BENCHMARKS.md: the
    # indexer's CPU per document).
    await create_task(pool)
    worker = await start_worker(KB_EMBEDDING_PROVIDER="hashing")
    frozen = await worker.wait_for("heap.frozen")
    assert frozen["objects"] > 10_000
    assert frozen["young_collection_threshold"] == YOUNG_COLLECTION_THRESHOLD
    await worker.wait_for("task.claimed")
    worker.process.send_signal(signal.SIGTERM)
    assert await worker.exit_code() == 0


async def test_sigterm_lets_the_running_task_finish_within_the_grace_period(
    start_worker: Any, pool: asyncpg.Pool[Any]
) -> None:
    created = await create_task(pool)
    worker = await start_worker(
        hang_generations=1,
        KB_INDEXER_LEASE_SECONDS="30",
        KB_EMBEDDING_PROVIDER="hashing",
        KB_INDEXER_GRACE_PERIOD_SECONDS="0.5",
    )
    await worker.wait_for("task.claimed")
    worker.process.send_signal(signal.SIGTERM)
    await worker.wait_for("worker.stopping")
    # The hanging task outlives the grace period: it is abandoned, nothing is written,
    # and the process still exits 0.
    assert await worker.exit_code() == 0
    assert any('"event": "task.abandoned"' in line for line in worker.lines)
    row = await pool.fetchrow(
        "SELECT status, attempts FROM index_task WHERE task_id = $1", created.task_id
    )
    assert row is not None
    assert (row["status"], row["attempts"]) == ("RUNNING", 1)


async def test_run_once_prints_failed_when_it_cannot_classify_an_error(
    service_env: dict[str, str],
) -> None:
    # Defect 9's other half: an error run-once cannot classify (here: no database at all)
    # exited 1 with nothing on stdout. It prints FAILED, the error on stderr, exits 1.
    env = {**service_env, "DATABASE_URL": "postgresql://kb:s3cretpw@127.0.0.1:1/kb"}
    code, out, err = await kb(env, "indexer", "run-once", "--tier", "standard")
    assert (code, out) == (1, "FAILED\n"), err
    assert "DATABASE_UNAVAILABLE" in err
    assert "s3cretpw" not in err
    assert "Traceback" not in err
