"""How long the dev stack's broker takes to start, with its log written and without.

    uv run python -m bench.dev_broker_start --runs 5

Each run starts a fresh single-node broker (``LocalKafka.up``: storage formatted, the JVM
started, the port open, a controller named) on ports of its own below the ephemeral range,
in a temporary home, and stops it; the two classpaths alternate, so machine load hits both
alike. "no binding" is the resolved jars less log4j-slf4j-impl (the broker's slf4j falls
back to its no-op logger, as before the binding was resolved); "log4j2" is all of them.
Figures: the median and minimum wall time of each, and the medians' ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from kbtools.chaos.rig.ports import listen_port
from kbtools.devstack.kafka import LocalKafka
from kbtools.devstack.settings import DevStackSettings

BINDING = "log4j-slf4j-impl-"


def _distribution(jars: Path, home: Path, *, binding: bool) -> Path:
    """An unpacked-distribution layout (``libs/*.jar``) of the resolved jars, for KAFKA_HOME."""
    libs = home / "libs"
    libs.mkdir(parents=True)
    for jar in jars.glob("*.jar"):
        if binding or not jar.name.startswith(BINDING):
            (libs / jar.name).symlink_to(jar)
    return home


def _start_once(kafka_home: Path, work: Path) -> tuple[float, int]:
    """Seconds from ``up`` to a ready broker, and the lines its log holds then."""
    taken: set[int] = set()
    settings = DevStackSettings(
        home=work,
        kafka_port=listen_port(taken=taken),
        kafka_controller_port=listen_port(taken=taken),
    )
    kafka = LocalKafka(settings)
    os.environ["KAFKA_HOME"] = str(kafka_home)
    started = time.perf_counter()
    try:
        kafka.up()
        elapsed = time.perf_counter() - started
        lines = len(kafka.log_file.read_text().splitlines()) if kafka.log_file.exists() else 0
    finally:
        kafka.down()
    return elapsed, lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    jars = LocalKafka(DevStackSettings()).fetch_jars()
    times: dict[str, list[float]] = {"no binding": [], "log4j2": []}
    logged: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="kb-broker-start-") as tmp:
        root = Path(tmp)
        homes = {
            "no binding": _distribution(jars, root / "plain", binding=False),
            "log4j2": _distribution(jars, root / "logged", binding=True),
        }
        for run in range(args.runs):
            for name, home in homes.items():
                elapsed, lines = _start_once(home, root / f"{name.replace(' ', '-')}-{run}")
                times[name].append(elapsed)
                logged[name] = lines
    base = statistics.median(times["no binding"])
    print("| classpath | median s | min s | log lines at ready | median / no binding |")
    print("|---|---:|---:|---:|---:|")
    for name, samples in times.items():
        median = statistics.median(samples)
        print(
            f"| {name} | {median:.2f} | {min(samples):.2f} | {logged[name]} "
            f"| {median / base:.2f}x |"
        )


if __name__ == "__main__":
    main()
