"""No `kb` command prints the database password, whatever is wrong with the settings.

Every command reports errors through one redacting path (services.runtime.commands.cli_support):
settings that do not validate are named without their values, and every message is
redacted before it is printed. Each command is started as an operator would, with a
DATABASE_URL that holds a password and something else wrong.
"""

from __future__ import annotations

import asyncio
import os
import uuid

import pytest

from tests.support.cli import kb_async

pytestmark = pytest.mark.e2e

PASSWORD = "s3cretpw"
WAIT = 60.0
TASK = str(uuid.uuid4())

COMMANDS = [
    ("indexer", "run", "--tier", "standard"),
    ("indexer", "run-once", "--tier", "standard"),
    ("tasks", "list"),
    ("tasks", "show", TASK),
    ("tasks", "requeue", TASK, "--by", "ops"),
    ("migrate",),
    ("relay", "run"),
    ("serve", "--port", "1"),
    ("tenants", "create", "acme", "--tier", "standard"),
]

BROKEN = {
    # Not a PostgreSQL URL: pydantic's own message would repeat the whole URL.
    "bad-scheme": {"DATABASE_URL": f"mysql://kb:{PASSWORD}@127.0.0.1:1/kb"},
    # Another setting is wrong, next to a URL with a password.
    "bad-pool-size": {
        "DATABASE_URL": f"postgresql://kb:{PASSWORD}@127.0.0.1:1/kb",
        "KB_DB_POOL_MAX_SIZE": "not-a-number",
    },
    # The driver refuses the URL's options.
    "bad-sslmode": {"DATABASE_URL": f"postgresql://kb:{PASSWORD}@127.0.0.1:1/kb?sslmode=bogus"},
}


def _environment(broken: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KB_", "DATABASE_URL"))}
    env.update(broken)
    return env


@pytest.mark.parametrize("broken", sorted(BROKEN))
async def test_a_broken_setting_never_prints_the_password(broken: str) -> None:
    env = _environment(BROKEN[broken])
    # A few at a time: each is a whole `kb` process starting up.
    gate = asyncio.Semaphore(3)

    async def run(command: tuple[str, ...]) -> tuple[int, str, str]:
        async with gate:
            return await kb_async(env, *command, seconds=WAIT)

    results = await asyncio.gather(*(run(command) for command in COMMANDS))
    for command, (code, out, err) in zip(COMMANDS, results, strict=True):
        shown = f"kb {' '.join(command)}: exit {code}\n{out}{err}"
        assert code != 0, shown
        assert PASSWORD not in out, shown
        assert PASSWORD not in err, shown
        assert "error" in err.lower(), shown
        if broken != "bad-sslmode":
            # Settings errors are the operator's to fix: exit 2, naming the setting.
            assert code == 2, shown
            assert "invalid configuration" in err, shown
            assert ("DATABASE_URL" if broken == "bad-scheme" else "db_pool_max_size") in err, shown
