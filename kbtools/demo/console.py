"""How the demo talks to a person: one line per step with what happened and how long it
took, a spinner while it waits (on a terminal only), and a summary table at the end."""

from __future__ import annotations

import itertools
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TextIO


class StepFailed(Exception):
    def __init__(self, step: str, reason: str, log: str | None = None) -> None:
        super().__init__(f"{step}: {reason}")
        self.step = step
        self.reason = reason
        self.log = log


@dataclass
class StepRecord:
    title: str
    outcome: str
    seconds: float


@dataclass
class Step:
    title: str
    outcome: str = ""
    log: str | None = None  # the log a failure points at
    waiting: str = ""

    def done(self, outcome: str) -> None:
        self.outcome = outcome

    def wait_for(self, what: str) -> None:
        self.waiting = what

    def until(self, what: str, check: Callable[[], Any], timeout: float = 180) -> Any:
        """Poll ``check`` until it returns something truthy (shown on the spinner meanwhile)."""
        self.waiting = what
        deadline = time.monotonic() + timeout
        while True:
            result = check()
            if result:
                self.waiting = ""
                return result
            if time.monotonic() > deadline:
                raise StepFailed(self.title, f"gave up waiting for {what}", self.log)
            time.sleep(0.1)


@dataclass
class Console:
    out: TextIO = field(default_factory=lambda: sys.stdout)
    records: list[StepRecord] = field(default_factory=list)

    @property
    def interactive(self) -> bool:
        return self.out.isatty()

    def say(self, text: str = "") -> None:
        print(text, file=self.out, flush=True)

    @contextmanager
    def step(self, title: str) -> Iterator[Step]:
        step = Step(title)
        started = time.monotonic()
        stop = threading.Event()
        spinner = threading.Thread(target=self._spin, args=(step, started, stop), daemon=True)
        if self.interactive:
            spinner.start()
        try:
            yield step
        except StepFailed:
            raise
        except Exception as error:
            raise StepFailed(title, f"{type(error).__name__}: {error}", step.log) from error
        finally:
            stop.set()
            if spinner.is_alive():
                spinner.join()
                self.out.write("\r\033[K")
        seconds = time.monotonic() - started
        self.records.append(StepRecord(title, step.outcome, seconds))
        self.say(f"✓ {title}: {step.outcome} ({seconds:.1f} s)")

    def _spin(self, step: Step, started: float, stop: threading.Event) -> None:
        for frame in itertools.cycle("⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"):
            if stop.wait(0.1):
                return
            waiting = f" — {step.waiting}" if step.waiting else ""
            line = f"\r{frame} {step.title}{waiting} ({time.monotonic() - started:.0f} s)"
            self.out.write(line[:160] + "\033[K")
            self.out.flush()

    def failed(self, error: StepFailed) -> None:
        self.say(f"✗ {error.step}: {error.reason}")
        if error.log:
            self.say(f"  see the log: {error.log}")

    def summary(self) -> None:
        width = max([len(r.title) for r in self.records] + [4])
        self.say()
        self.say(f"{'step':<{width}}  {'time':>7}  what happened")
        self.say(f"{'-' * width}  {'-' * 7}  {'-' * 40}")
        for record in self.records:
            self.say(f"{record.title:<{width}}  {record.seconds:>6.1f}s  {record.outcome}")
