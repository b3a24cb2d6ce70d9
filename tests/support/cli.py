"""Running `kb` as a user would: a child process of this interpreter, in the repository."""

from __future__ import annotations

import asyncio
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


async def kb_async(
    env: dict[str, str], *args: str, stdin: bytes | None = None, seconds: float = 60
) -> tuple[int, str, str]:
    """``kb`` without blocking the event loop (tests that serve or run beside it): the exit
    code, stdout and stderr; killed if it outlasts ``seconds``."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "services.cli",
        *args,
        env=env,
        cwd=REPO_ROOT,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        async with asyncio.timeout(seconds):
            out, err = await process.communicate(stdin)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()
