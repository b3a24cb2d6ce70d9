"""A SIGKILLed indexer leaves no parse process behind: each one notices its indexer is gone
and exits (a killed indexer closes no pipe its parse processes wait on)."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys

import pytest

from tests.support.stack import REPO_ROOT

pytestmark = pytest.mark.e2e


def test_parse_processes_exit_when_their_indexer_is_killed() -> None:
    holder = subprocess.Popen(
        [sys.executable, "-m", "tests.support.parse_pool_holder"],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        pids = [int(pid) for pid in holder.stdout.readline().split()]
        # The forkserver and two parse processes (and the resource tracker) at least.
        assert len(pids) >= 3, pids
        watched = [os.pidfd_open(pid) for pid in pids]
        holder.send_signal(signal.SIGKILL)
        assert holder.wait(timeout=10) == -signal.SIGKILL
        for pid, pidfd in zip(pids, watched, strict=True):
            # A pidfd turns readable when its process exits: no polling loop.
            readable, _, _ = select.select([pidfd], [], [], 15)
            assert readable, f"process {pid} outlived its killed indexer"
            os.close(pidfd)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
        if holder.stdout is not None:
            holder.stdout.close()
