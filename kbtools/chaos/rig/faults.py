"""The fault driver: carries out the seeded schedule against the running processes, each
fault on its own thread at its moment (faults overlap, as they do in production), and
counts what it did."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import httpx

from kbtools.chaos.rig.schedule import Fault, FaultKind
from kbtools.chaos.rig.topology import ChaosStack
from services.runtime.pg.sql import queries_beside

QUERIES = queries_beside(__file__, "rig.sql")
SECOND_MODEL = "hashing-v1-256"
SECOND_CHUNK_TOKENS = 200
SWITCHED_TENANT = "acme"
_PROVIDER_FAULTS = {
    FaultKind.PROVIDER_429: "rate_limit",
    FaultKind.PROVIDER_5XX: "server_error",
    FaultKind.PROVIDER_TIMEOUT: "hang",
    FaultKind.PROVIDER_MALFORMED: "malformed",
}


@dataclass
class FaultRecord:
    done: Counter[str] = field(default_factory=Counter)
    failed: list[str] = field(default_factory=list)
    generation_id: int | None = None
    generation_switched: bool = False
    # (process name, pid, task id) of each SIGKILL sent right after that task's commit
    after_commit: list[tuple[str, int, str]] = field(default_factory=list)


def completed_since(rows: Sequence[Mapping[str, Any]]) -> tuple[str | None, list[str]]:
    """Of the rows of the tasks a process held at the last look and of those it holds now
    (task_id, status, mine: still under its lease): one of the held ones that completed
    under its lease since, if any (a takeover's completion is another owner's), and the
    tasks it holds now."""
    committed = next(
        (str(r["task_id"]) for r in rows if r["status"] == "SUCCEEDED" and r["mine"]), None
    )
    held = [str(r["task_id"]) for r in rows if r["status"] == "RUNNING" and r["mine"]]
    return committed, held


def logged_before_kill(logs: Path, after_commit: list[tuple[str, int, str]]) -> int:
    """Of the kills right after a commit, those that struck before the worker even logged
    the completion (its `task.completed` line, written right after the commit)."""
    early = 0
    for name, pid, task_id in after_commit:
        log = logs / f"{name}.log"
        text = log.read_text(errors="replace") if log.exists() else ""
        logged = any(
            '"task.completed"' in line and task_id in line and f":{pid}:" in line
            for line in text.splitlines()
        )
        early += not logged
    return early


class FaultDriver:
    def __init__(self, stack: ChaosStack, schedule: list[Fault]) -> None:
        self.stack = stack
        self.schedule = schedule
        self.record = FaultRecord()
        self.processes = threading.Lock()  # DemoProcesses keeps one state file
        self.servers = threading.Lock()  # one broker or database outage at a time
        self.threads: list[threading.Thread] = []

    def run(self, started: float) -> None:
        for fault in self.schedule:
            time.sleep(max(0.0, started + fault.at_s - time.monotonic()))
            thread = threading.Thread(target=self._apply, args=(fault,), daemon=True)
            thread.start()
            self.threads.append(thread)

    def join(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _apply(self, fault: Fault) -> None:
        try:
            self._carry_out(fault)
            self.record.done[fault.kind.value] += 1
        except Exception as error:  # a fault that could not be applied is reported, not fatal
            self.record.failed.append(f"{fault.describe()}: {error!r}"[:300])

    def _carry_out(self, fault: Fault) -> None:
        stack, kind = self.stack, fault.kind
        if kind in (FaultKind.KILL_INDEXER, FaultKind.STOP_INDEXER):
            # Strike while it holds a task (waiting a few seconds at most): a kill of an
            # idle worker proves little.
            self.record.done["struck mid-task"] += self._await_busy(fault.target, within_s=5)
        if kind is FaultKind.KILL_AFTER_COMMIT:
            # The SIGKILL itself is sent the moment the commit shows (below); a process
            # that completed nothing in time is killed all the same, and not counted.
            self.record.done["struck right after a commit"] += self._kill_after_commit(
                fault.target, within_s=15
            )
        if kind in (
            FaultKind.KILL_INDEXER,
            FaultKind.KILL_AFTER_COMMIT,
            FaultKind.KILL_RELAY,
            FaultKind.KILL_INGEST,
            FaultKind.PROVIDER_DOWN,
        ):
            with self.processes:
                stack.kill(fault.target)
            time.sleep(fault.duration_s)
            self._restart(fault.target)
        elif kind is FaultKind.STOP_INDEXER:
            stack.signal(fault.target, signal.SIGSTOP)
            time.sleep(fault.duration_s)
            stack.signal(fault.target, signal.SIGCONT)
        elif kind is FaultKind.KAFKA_OUTAGE:
            with self.servers:
                stack.stop_kafka()
                time.sleep(fault.duration_s)
                stack.start_kafka()
        elif kind is FaultKind.POSTGRES_RESTART:
            with self.servers:
                stack.restart_postgres()
        elif kind in _PROVIDER_FAULTS:
            body = {
                "kind": _PROVIDER_FAULTS[kind],
                "seconds": fault.duration_s,
                "retry_after_seconds": 2,
            }
            deadline = time.monotonic() + 30  # the provider may be down at this moment
            while True:
                try:
                    httpx.post(f"{stack.provider_url}/_control/fault", json=body, timeout=5)
                    return
                except httpx.TransportError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.5)
        elif kind is FaultKind.RELAY_REPLAY:
            # As an operator would: run again after a failure (another fault may hold the
            # database or the broker down at this moment).
            since = (datetime.now(UTC) - timedelta(seconds=30)).isoformat()
            deadline = time.monotonic() + 120
            while True:
                status, output = stack.kb_status("relay", "replay", "--since", since, timeout=180)
                if status == 0:
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"kb relay replay exited {status}: {output[-300:]}")
                time.sleep(2)
        elif kind is FaultKind.GENERATION_SWITCH:
            self._generation()

    def _restart(self, name: str) -> None:
        """Start ``name`` again, as a supervisor does after a kill. Every service waits for
        the database and the broker at start by itself (docs/operations.md), so a process
        that exits at start, even while PostgreSQL restarts, is a failure the run reports."""
        with self.processes:
            self.stack.start(name)

    def _await_busy(self, name: str, within_s: float) -> bool:
        pid = self.stack.pid(name)
        if pid is None:
            return False
        return asyncio.run(self._busy(pid, within_s))

    async def _busy(self, pid: int, within_s: float) -> bool:
        deadline = time.monotonic() + within_s
        try:
            conn = await asyncpg.connect(self.stack.database_url, timeout=2)
        except (OSError, asyncpg.PostgresError):
            return False
        try:
            while time.monotonic() < deadline:
                if await conn.fetchval(QUERIES["worker_holds_running_task"], str(pid)):
                    return True
                await asyncio.sleep(0.05)
        except (OSError, asyncpg.PostgresError):
            return False
        finally:
            await conn.close()
        return False

    def _kill_after_commit(self, name: str, within_s: float) -> bool:
        pid = self.stack.pid(name)
        if pid is None:
            return False
        struck = asyncio.run(self._commit_then_kill(pid, within_s))
        if struck is not None:
            self.record.after_commit.append((name, pid, struck))
        return struck is not None

    async def _commit_then_kill(self, pid: int, within_s: float) -> str | None:
        """SIGKILL ``pid`` as soon as one of the tasks it holds is SUCCEEDED under its lease:
        its completion (chunks, pointer, task, outbox event) committed, and the worker has
        not yet acknowledged the hint, logged the completion or claimed its next task. The
        task rows are polled every few milliseconds through their indexes (the running
        tasks' partial index, then the primary key)."""
        deadline = time.monotonic() + within_s
        owner = f"%:{pid}:%"
        try:
            conn = await asyncpg.connect(self.stack.database_url, timeout=2)
        except (OSError, asyncpg.PostgresError):
            return None
        try:
            held: list[str] = []
            while time.monotonic() < deadline:
                rows = await conn.fetch(QUERIES["held_tasks"], owner, held)
                committed, held = completed_since([dict(r.items()) for r in rows])
                if committed is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                    return committed
                await asyncio.sleep(0.005)
        except (OSError, asyncpg.PostgresError):
            return None
        finally:
            await conn.close()
        return None

    def _generation(self) -> None:
        output = self.stack.kb(
            "index",
            "generations",
            "create",
            "--provider",
            "default",
            "--model",
            SECOND_MODEL,
            "--dimensions",
            "256",
            # Other chunk settings than the default generation's: the chunk ids (which hash
            # the chunking strategy) then tell the two generations apart in an answer.
            "--chunk-tokens",
            str(SECOND_CHUNK_TOKENS),
            "--tenant",
            SWITCHED_TENANT,
        )
        self.record.generation_id = int(output.strip().split()[-1])
        self.try_switch(deadline_s=60)

    def try_switch(self, deadline_s: float) -> bool:
        """Switch the tenant to the new generation once it holds every served version
        (refused while the backfill or new publishes are behind)."""
        if self.record.generation_id is None or self.record.generation_switched:
            return self.record.generation_switched
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            status, _ = self.stack.kb_status(
                "index",
                "generations",
                "switch",
                "--tenant",
                SWITCHED_TENANT,
                "--to",
                str(self.record.generation_id),
            )
            if status == 0:
                self.record.generation_switched = True
                return True
            time.sleep(2)
        return False
