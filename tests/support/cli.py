"""Running `kb` as a user would: a child process of this interpreter, in the repository."""

from __future__ import annotations

import subprocess
import sys

from tests.support.stack import REPO_ROOT


def kb(env: dict[str, str], *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
