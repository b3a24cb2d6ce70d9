"""The short chaos run, as `kb chaos run` runs it: its own PostgreSQL with a streaming
replica, and Kafka (it restarts them), every kb process, every fault kind at least once, on
a fixed seed; no violation, and every new check given something to check.

It takes about three minutes, the short form CI runs (RELIABILITY.md has the command and its
table); `scripts/test --unit` leaves it out with the other e2e tests."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kbtools.chaos.rig.ports import listen_port
from tests.support.stack import REPO_ROOT

pytestmark = [pytest.mark.e2e, pytest.mark.integration]

SEED = 20261204


@pytest.fixture
def chaos_home() -> Iterator[Path]:
    """Not under pytest's basetemp: run as root, PostgreSQL runs as a user of its own, and
    another pytest session resets that tree to mode 0700 when it starts, locking the
    server out of its data directory mid-run."""
    home = Path(tempfile.mkdtemp(prefix="kb-chaos-"))
    yield home
    shutil.rmtree(home, ignore_errors=True)


@pytest.mark.timeout(900)
def test_short_chaos_run_keeps_every_invariant(chaos_home: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KB_", "DATABASE_URL"))}
    # Below the ephemeral range, as the run picks its own: it restarts these servers.
    taken: set[int] = set()
    env["KB_DEV_KAFKA_CONTROLLER_PORT"] = str(listen_port(taken=taken))
    env["PYTHONPATH"] = str(REPO_ROOT)
    done = subprocess.run(
        [
            sys.executable, "-m", "services.cli", "chaos", "run",
            "--seed", str(SEED), "--documents", "200", "--minutes", "2",
            "--home", str(chaos_home),
            "--pg-port", str(listen_port(taken=taken)),
            "--kafka-port", str(listen_port(taken=taken)),
        ],
        env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=880, check=False,
    )  # fmt: skip
    report = done.stdout + done.stderr[-3000:]
    assert done.returncode == 0, report
    assert "PASSED: no violation" in done.stdout, report
    for kind in (
        "SIGKILLs (indexers",
        "SIGKILLs aimed right after",
        "Kafka outages",
        "PostgreSQL restarts",
        "provider faults",
        "searches read from the replica",
        "searches passing a status's token",
        "hits checked against their version",
        "succeeded tasks re-run and compared",
    ):
        line = next(line for line in done.stdout.splitlines() if kind in line)
        figure = line.split("|")[2].strip()
        assert figure.split(), line
        assert figure.split()[0] != "0", line
    aimed = next(line for line in done.stdout.splitlines() if "SIGKILLs aimed right after" in line)
    assert "(0;" not in aimed, aimed  # at least one struck right after a commit
    # Deletes and erases, some while their task ran, each judged by searches after it, and
    # the erased versions' markers looked for in a pg_dump.
    removed = _figure(done.stdout, "deletes / erases answered")
    assert "0" not in removed.split(" / "), removed
    assert "while its task ran" in _figure(done.stdout, "of which")
    for kind in ("searches sent after a delete", "erased markers looked for"):
        assert _figure(done.stdout, kind).split()[0] != "0", kind
    # Publishes by signed command through the ingest topics, with their consumers killed;
    # every command sent applied (exactly once: the invariant's row, zero above).
    assert _figure(done.stdout, "SIGKILLs of ingest consumers") != "0"
    by_command = _figure(done.stdout, "versions published by ingest command")
    published, counts = by_command.split(" ", 1)
    sent, applied = counts.strip("()").split(" / ")
    assert published != "0", by_command
    assert sent == applied, by_command
    # Deletes and erases by command too, and a poison of each kind before some publishes:
    # each dead-lettered with its code while its partition moved on (the invariant's row).
    kinds = _figure(done.stdout, "ingest commands sent, by kind")
    assert "DeleteDocument" in kinds, kinds
    assert "EraseDocument" in kinds, kinds
    poisons = _figure(done.stdout, "poison commands, by kind")
    assert poisons.count(",") == 3, poisons  # all four kinds


def _figure(table: str, row: str) -> str:
    line = next(line for line in table.splitlines() if line.startswith(f"| {row}"))
    return line.split("|")[2].strip()
