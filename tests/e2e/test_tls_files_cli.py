"""A missing TLS file named by DATABASE_URL stops each long-running `kb` process at start
(services/runtime/pg/tls_files.py): exit 2 and a message naming the parameter and path, not
the password; `kb serve` logs serve.start_failed first. Before, asyncpg's FileNotFoundError
read as a database that is away and each of them waited for it for ever."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from tests.support.cli import kb_async

pytestmark = pytest.mark.e2e

PASSWORD = "s3cretpw"
# Ample for a start that fails at once; a process still waiting for the database is killed.
WAIT = 60.0

COMMANDS = [
    ("serve", "--port", "0"),
    ("relay", "run"),
    ("indexer", "run", "--tier", "standard"),
]


async def test_a_missing_root_certificate_ends_the_start(tmp_path: Path) -> None:
    missing = tmp_path / "absent-ca.pem"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KB_", "DATABASE_URL"))}
    env["DATABASE_URL"] = (
        f"postgresql://kb:{PASSWORD}@127.0.0.1:1/kb?sslmode=verify-full&sslrootcert={missing}"
    )
    results = await asyncio.gather(*(kb_async(env, *c, seconds=WAIT) for c in COMMANDS))
    for command, (code, out, err) in zip(COMMANDS, results, strict=True):
        shown = f"kb {' '.join(command)}: exit {code}\n{out}{err}"
        assert code == 2, shown
        assert f"sslrootcert={missing} cannot be read" in err.splitlines()[-1], shown
        assert "CONFIG_INVALID" in err, shown
        assert "database.unavailable" not in err, shown
        assert PASSWORD not in out + err, shown
    serve_log = results[0][2]
    assert '"event": "serve.start_failed"' in serve_log, serve_log
