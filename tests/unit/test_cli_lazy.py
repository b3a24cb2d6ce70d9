"""`kb` imports a sub-command only when it is used: `kb --help` pays for none of them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from services.cli import COMMANDS, load_command
from tests.support.stack import REPO_ROOT

HEAVY = ("asyncpg", "fastapi", "aiokafka", "uvicorn", "pydantic_settings", "starlette")

_PROBE = """
import json, sys
sys.argv = ["kb", *json.loads(sys.argv[1])]
from services.cli import main
try:
    main()
except SystemExit:
    pass
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in %s)), file=sys.stderr)
"""


def _heavy_modules_after(*args: str) -> list[str]:
    probe = _PROBE % (HEAVY,)
    done = subprocess.run(
        [sys.executable, "-c", probe, json.dumps(list(args))],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    loaded: list[str] = json.loads(done.stderr.strip().splitlines()[-1])
    return loaded


def test_importing_the_entry_point_imports_no_driver_nor_the_web_stack() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json, sys, services.cli; "
            f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY})))",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert json.loads(done.stdout) == []


def test_kb_help_lists_every_command_without_importing_them() -> None:
    assert _heavy_modules_after("--help") == []
    assert _heavy_modules_after("tenants", "--help") == []


@pytest.mark.parametrize("name", list(COMMANDS))
def test_each_summary_is_the_commands_own_help(name: str) -> None:
    command = load_command(name)
    assert command.name == name
    assert (command.help or "").strip().splitlines()[0] == COMMANDS[name].summary
