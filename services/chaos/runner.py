"""One chaos run: bring the system up, drive load and searches while the seeded faults
happen, let it settle, check every invariant, print the table."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from services.chaos.checker import Checker, CheckResult, settle
from services.chaos.faults import FaultDriver
from services.chaos.load import LoadDriver
from services.chaos.report import evidence, table
from services.chaos.schedule import plan
from services.chaos.searcher import Searcher
from services.chaos.topology import ChaosStack


@dataclass(frozen=True)
class ChaosOptions:
    seed: int
    documents: int
    minutes: float
    faults: int
    home: Path
    pg_port: int | None = None
    kafka_port: int | None = None
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
    say(f"kb chaos: seed {options.seed}, {options.documents} documents, {load_s:.0f} s of load")
    say("schedule:")
    for fault in schedule:
        say(f"  {fault.describe()}")
    stack = ChaosStack(options.home, pg_port=options.pg_port, kafka_port=options.kafka_port)
    started_wall = time.monotonic()
    try:
        say(
            f"bringing up PostgreSQL :{stack.dev.pg_port}, Kafka :{stack.dev.kafka_port} "
            f"and the processes (logs in {stack.processes.home})"
        )
        stack.up()
        stop_searching = threading.Event()
        searcher = Searcher(stack, options.seed, stop_searching)
        load = LoadDriver(stack, options.seed, options.documents, load_s)
        faults = FaultDriver(stack, schedule)
        started = time.monotonic()
        threads = [
            threading.Thread(target=searcher.run, daemon=True),
            threading.Thread(target=load.run, daemon=True),
            threading.Thread(target=faults.run, args=(started,), daemon=True),
        ]
        for thread in threads:
            thread.start()
        threads[2].join()
        faults.join(timeout_s=300)
        threads[1].join()
        say(f"load and faults done after {time.monotonic() - started:.0f} s; settling")
        # Every kill is followed by a restart: a process not running now exited by itself.
        died = _restart_dead(stack)
        converge_s = asyncio.run(settle(stack, options.settle_timeout_s))
        if not faults.try_switch(deadline_s=120):
            say("the new generation could not be switched to (documents missing from it)")
        asyncio.run(settle(stack, options.settle_timeout_s))
        died += _restart_dead(stack)
        time.sleep(2)  # a few searches of the settled system too
        stop_searching.set()
        threads[0].join(timeout=15)
        say("checking")
        checked = asyncio.run(Checker(stack, searcher.record).check())
        for name, last_words in died:
            checked.violate("every process recovers by itself", f"{name} exited: {last_words}")
        if converge_s is None:
            checked.violate(
                "tasks settled", f"not settled {options.settle_timeout_s:.0f} s after the faults"
            )
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
            converge_s is not None,
        )
    finally:
        if options.keep:
            say(f"kept running: DATABASE_URL={stack.database_url}")
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
