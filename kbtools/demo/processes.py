"""The demo's child processes: started detached (they outlive `kb demo`), logs to files
under ``.kb/demo/``, remembered in ``state.json`` so a second `kb demo` reuses them and
`kb demo --stop` stops every one."""

from __future__ import annotations

import json
import os
import signal
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kbtools.devstack.process import cmdline, pid_alive, spawn_detached, terminate


@dataclass
class Child:
    name: str
    pid: int
    argv: list[str]
    log: str

    def alive(self) -> bool:
        # The pid must still be ours: after a reboot it may belong to anything.
        return pid_alive(self.pid) and cmdline(self.pid).strip() == " ".join(self.argv)


@dataclass
class DemoState:
    children: dict[str, Child] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)


class DemoProcesses:
    def __init__(self, home: Path) -> None:
        self.home = home
        self.state_file = home / "state.json"
        self.state = self._load()

    def _load(self) -> DemoState:
        try:
            raw = json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            return DemoState()
        children = {name: Child(**child) for name, child in raw.get("children", {}).items()}
        return DemoState(children, raw.get("values", {}))

    def save(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        payload = {
            "children": {name: asdict(child) for name, child in self.state.children.items()},
            "values": self.state.values,
        }
        temporary = self.state_file.with_suffix(".tmp")
        temporary.write_text(json.dumps(payload, indent=2, sort_keys=True))
        temporary.replace(self.state_file)

    def running(self, name: str) -> Child | None:
        child = self.state.children.get(name)
        return child if child is not None and child.alive() else None

    def start(self, name: str, args: list[str], env: dict[str, str]) -> Child:
        """Start ``python -m <args>`` as ``name`` unless it already runs."""
        existing = self.running(name)
        if existing is not None:
            return existing
        self.home.mkdir(parents=True, exist_ok=True)
        log = self.home / f"{name}.log"
        argv = [sys.executable, "-m", *args]
        pid = spawn_detached(argv, log, env)
        child = Child(name, pid, argv, str(log))
        self.state.children[name] = child
        self.save()
        return child

    def kill(self, name: str) -> None:
        """SIGKILL, as a crash would."""
        child = self.state.children.get(name)
        if child is not None and child.alive():
            os.kill(child.pid, signal.SIGKILL)
            terminate(child.pid, grace_s=5)  # reaps it

    def stop_all(self, *, grace_s: float = 15) -> list[str]:
        stopped = []
        for name, child in list(self.state.children.items()):
            if child.alive():
                terminate(child.pid, grace_s=grace_s)
                stopped.append(name)
            del self.state.children[name]
        self.save()
        return stopped
