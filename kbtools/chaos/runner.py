"""One chaos run: bring the system up, drive load and searches while the seeded faults
happen, let it settle, check every invariant, print the table."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kbtools.chaos.checks.checker import Checker
from kbtools.chaos.checks.converge import converge, replica_caught_up, settle
from kbtools.chaos.checks.report import evidence, table
from kbtools.chaos.checks.rerun import RerunEvidence, prepare, reread, sample_size
from kbtools.chaos.checks.result import RECOVERS, CheckResult
from kbtools.chaos.rig.faults import FaultDriver, logged_before_kill
from kbtools.chaos.rig.schedule import plan
from kbtools.chaos.rig.topology import ChaosStack
from kbtools.chaos.traffic.load import LoadDriver
from kbtools.chaos.traffic.searcher import ReplayWatch, Searcher


@dataclass(frozen=True)
class ChaosOptions:
    seed: int
    documents: int
    minutes: float
    faults: int
    home: Path
    pg_port: int | None = None
    kafka_port: int | None = None
    replica_port: int | None = None
    settle_timeout_s: float = 240
    keep: bool = False  # leave the servers and processes running, to look at them


@dataclass
class ChaosOutcome:
    table: str
    evidence: str
    checked: CheckResult
    converged: bool

    @property
    def passed(self) -> bool:
        return self.converged and self.checked.total == 0


def run(options: ChaosOptions, command: str, say: Callable[[str], None] = print) -> ChaosOutcome:
    # The load takes the run's minutes; the faults fall in its first 80 %.
    load_s = options.minutes * 60
    schedule = plan(options.seed, fault_window_s=load_s * 0.8, faults=options.faults)
    begun = time.monotonic()

    def progress(line: str) -> None:  # with the run's elapsed time
        say(f"[{time.monotonic() - begun:5.0f} s] {line}")

    progress(
        f"kb chaos: seed {options.seed}, {options.documents} documents, {load_s:.0f} s of load"
    )
    progress("schedule:")
    for fault in schedule:
        say(f"  {fault.describe()}")
    stack = ChaosStack(
        options.home,
        pg_port=options.pg_port,
        kafka_port=options.kafka_port,
        replica_port=options.replica_port,
    )
    started_wall = time.monotonic()
    try:
        progress(
            f"bringing up PostgreSQL :{stack.dev.pg_port} (replica :{stack.replica.port}), "
            f"Kafka :{stack.dev.kafka_port} and the processes (logs in {stack.processes.home})"
        )
        stack.up()
        stop_searching = threading.Event()
        load = LoadDriver(stack, options.seed, options.documents, load_s)
        replay = ReplayWatch(stack.replica.url, stop_searching)
        searcher = Searcher(
            stack, options.seed, stop_searching, load.record.published, load.record.removed, replay
        )
        faults = FaultDriver(stack, schedule)
        started = time.monotonic()
        threads = [
            threading.Thread(target=searcher.run, daemon=True),
            threading.Thread(target=load.run, daemon=True),
            threading.Thread(target=faults.run, args=(started,), daemon=True),
            threading.Thread(target=replay.run, daemon=True),
        ]
        for thread in threads:
            thread.start()
        threads[2].join()
        faults.join(timeout_s=300)
        faults_ended = time.monotonic()
        progress(f"faults done after {faults_ended - started:.0f} s; waiting for convergence")
        # Every kill is followed by a restart: a process not running now exited by itself.
        died = _restart_dead(stack)
        converge_s = asyncio.run(converge(stack, faults_ended, options.settle_timeout_s))
        progress(
            "converged "
            + ("never" if converge_s is None else f"{converge_s:.1f} s after the last fault")
        )
        threads[1].join()
        load_ended_s = (load.ended or time.monotonic()) - started
        # Then what the load published after the faults: the run checks a settled system.
        settled = asyncio.run(settle(stack, options.settle_timeout_s))
        if not faults.try_switch(deadline_s=120):
            progress("the new generation could not be switched to (documents missing from it)")
        asyncio.run(settle(stack, options.settle_timeout_s))
        progress("re-running a sample of succeeded tasks (kb index check --repair)")
        rerun = _rerun(stack, options.seed, sample_size(options.documents))
        asyncio.run(settle(stack, options.settle_timeout_s))
        died += _restart_dead(stack)
        progress("checking that the replica streams again")
        replica_problem = asyncio.run(replica_caught_up(stack, timeout_s=60))
        stop_searching.set()
        threads[0].join(timeout=15)
        progress("checking the invariants")
        checked = asyncio.run(Checker(stack, searcher.record, load.record).check())
        rerun.check(checked)
        for name, last_words in died:
            checked.violate(RECOVERS, f"{name} exited: {last_words}")
        if replica_problem is not None:
            checked.violate(RECOVERS, f"replica-1: {replica_problem} 60 s after the run")
        if converge_s is None or settled is None:
            checked.violate(
                "tasks settled",
                f"not converged {options.settle_timeout_s:.0f} s after the last fault",
            )
        checked.figures["kills before the completion was logged"] = logged_before_kill(
            stack.processes.home, faults.record.after_commit
        )
        checked.figures["faults ended"] = faults_ended - started
        checked.figures["load ended"] = load_ended_s
        outcome = ChaosOutcome(
            table(
                command=command,
                seed=options.seed,
                load=load.record,
                faults=faults.record,
                checked=checked,
                converge_s=converge_s,
                elapsed_s=time.monotonic() - started_wall,
            ),
            evidence(checked, faults.record),
            checked,
            converge_s is not None and settled is not None,
        )
    finally:
        if options.keep:
            progress(f"kept running: DATABASE_URL={stack.database_url}")
        else:
            stack.down()
    say(outcome.table)
    if outcome.evidence:
        say(outcome.evidence)
    say("PASSED: no violation" if outcome.passed else f"FAILED: {checked.total} violation(s)")
    return outcome


def _restart_dead(stack: ChaosStack) -> list[tuple[str, str]]:
    """The processes that exited by themselves (with their log's last line), restarted."""
    died = []
    for name in list(stack.processes.state.children):
        if stack.processes.running(name) is None:
            lines = stack.log(name).read_text(errors="replace").strip().splitlines()
            died.append((name, (lines[-1] if lines else "")[:300]))
            stack.start(name)
    return died


def _rerun(stack: ChaosStack, seed: int, count: int) -> RerunEvidence:
    """A seeded sample of served versions damaged, repaired by re-running their SUCCEEDED
    tasks as an operator does, and read again (kbtools/chaos/checks/rerun.py)."""
    before, reruns_before = asyncio.run(prepare(stack.database_url, seed, count))
    status, output = stack.kb_status("index", "check", "--repair", "--timeout", "180")
    after, reruns_after = asyncio.run(reread(stack.database_url, list(before)))
    return RerunEvidence(before, after, reruns_before, reruns_after, status, output)
