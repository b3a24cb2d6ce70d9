"""Figures the checker reads from the processes' JSON logs: which server answered each
search, and the indexers' lost leases and takeovers."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any


def _entries(log: Path) -> Iterator[dict[str, Any]]:
    if not log.exists():
        return
    for line in log.read_text(errors="replace").splitlines():
        if not line.startswith("{"):
            continue
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict):
            yield entry


def search_reads(api_log: Path) -> tuple[int, int]:
    """Searches answered from a replica and from the primary, from the API's
    `search.served` lines."""
    replica = primary = 0
    for entry in _entries(api_log):
        if entry.get("event") != "search.served":
            continue
        if entry.get("read_from") == "primary":
            primary += 1
        elif entry.get("read_from"):
            replica += 1
    return replica, primary


def lease_figures(indexer_logs: Iterable[Path]) -> tuple[int, int]:
    """Lost leases and takeovers: a takeover is a claim of a task whose previous attempt
    never ended (its worker killed, stopped or cut off)."""
    lost = 0
    claimed: set[tuple[str, int]] = set()
    ended: set[tuple[str, int]] = set()
    for log in indexer_logs:
        for entry in _entries(log):
            event = entry.get("event")
            attempt = (str(entry.get("task_id")), int(entry.get("lease_attempt") or 0))
            if event == "lease.lost":
                lost += 1
            elif event == "task.claimed":
                claimed.add(attempt)
            elif event in ("task.completed", "task.failed", "task.abandoned"):
                ended.add(attempt)
    takeovers = sum(
        1
        for task, attempt in claimed
        if attempt > 1 and (task, attempt - 1) in claimed and (task, attempt - 1) not in ended
    )
    return lost, takeovers
