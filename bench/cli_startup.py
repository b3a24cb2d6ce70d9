"""How long `kb` takes before it prints anything, against the floors it cannot go below.

    uv run python -m bench.cli_startup --runs 20

Each command runs --runs times, interleaved (so machine load hits all alike); figures are
the median and minimum wall time per command and each median's ratio to the interpreter's
own start (`python -c pass`). "eager imports" is what `kb` imported before it printed its
help when every sub-command module was imported up front.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from tests.support.stack import REPO_ROOT

KB = [sys.executable, "-m", "services.cli"]
EAGER = (
    "import kbtools.devstack.cli, services.indexer.cli, services.publisher.cli, "
    "services.relay.cli, services.runtime.commands.cli"
)
COMMANDS: dict[str, list[str]] = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "python -c 'import typer'": [sys.executable, "-c", "import typer"],
    "kb --help": [*KB, "--help"],
    "kb tenants --help": [*KB, "tenants", "--help"],
    "kb indexer run-once --help": [*KB, "indexer", "run-once", "--help"],
    "eager imports (before)": [sys.executable, "-c", EAGER],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(args.runs):
        for name, command in COMMANDS.items():
            started = time.perf_counter()
            subprocess.run(command, cwd=REPO_ROOT, capture_output=True, check=True)
            times[name].append(time.perf_counter() - started)
    floor = statistics.median(times["python -c pass"])
    print("| command | median s | min s | median / python start |")
    print("|---|---|---|---|")
    for name, samples in times.items():
        median = statistics.median(samples)
        print(f"| {name} | {median:.3f} | {min(samples):.3f} | {median / floor:.1f}x |")


if __name__ == "__main__":
    main()
