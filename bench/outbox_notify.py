"""What the relay's wake-up NOTIFY costs publishers: commits/s with and without it.

    uv run python -m bench.outbox_notify --writers 16 --seconds 5 --rounds 3 --client pgbench

--writers connections each repeat a publish-like transaction: BEGIN, one outbox row (its
own document) by ``add_event``'s own statement (services/runtime/messaging/outbox.sql), COMMIT. The
writers are pgbench (``--client pgbench``: a C client, so the server, not the client, is
what saturates) or asyncpg connections in this process (``--client asyncpg``, through
``add_event`` itself; on a small machine the Python client saturates first).

Three modes, alternately, --rounds times each, in one run on one database:
- ``notify every commit``: the doorbell stays armed (no relay disarms it), so every
  insert notifies -- the behaviour before migration 0008;
- ``doorbell``: a relay-like listener disarms the doorbell when a notification arrives and
  re-arms it --drain-ms later (a relay that wakes, drains and waits again);
- ``no trigger``: the trigger disabled, the ceiling.
A notifying transaction takes a cluster-wide lock at commit (PostgreSQL serialises the
commits of notifying transactions), so the figures to read are the ratios.
``--synchronous-commit`` sets the writers' synchronous_commit (the dev stack runs with
fsync off, which makes commits, and so the time the lock is held, cheaper than on a
durable server). Needs DATABASE_URL; creates and drops a database of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import asyncpg

from bench.databases import recreate_database
from services.runtime.messaging.outbox import OutboxEvent, add_event, aggregate_key
from services.runtime.pg.sql import queries_beside
from services.runtime.settings import RuntimeSettings

INSERT_EVENT = queries_beside(
    str(Path(__file__).resolve().parent.parent / "services/runtime/messaging/outbox.py"),
    "outbox.sql",
)["insert_event"]

BENCH_DB = "kb_bench_outbox_notify"
TRIGGER = "outbox_notify_relay"


async def _database(admin_url: str) -> str:
    return await recreate_database(admin_url, BENCH_DB, migrate=True)


async def _publish_for(conn: asyncpg.Connection[Any], until: float) -> int:
    done = 0
    while time.perf_counter() < until:
        async with conn.transaction():
            await add_event(
                conn,
                OutboxEvent(
                    event_type="DocumentVersionPublished",
                    tenant_id="acme",
                    tier="standard",
                    aggregate_key=aggregate_key("acme", uuid.uuid4()),
                    payload=b"x" * 200,
                ),
            )
        done += 1
    return done


def _pgbench_script() -> str:
    """add_event's statement with pgbench variables for its parameters."""
    statement = INSERT_EVENT
    for number, value in (
        (6, "'\\x" + "78" * 200 + "'::bytea"),
        (5, "('acme/' || :document)"),
        (4, "'standard'"),
        (3, "'acme'"),
        (2, "'DocumentVersionPublished'"),
        (1, "gen_random_uuid()"),
    ):
        statement = statement.replace(f"${number}", value)
    statement = " ".join(line.split("--")[0].strip() for line in statement.splitlines())
    return f"\\set document random(1, 2000000000)\nBEGIN;\n{statement.strip()};\nCOMMIT;\n"


def _pgbench_phase(url: str, script: Path, writers: int, seconds: float, sync: str) -> float:
    env = {**os.environ, "PGOPTIONS": f"-c synchronous_commit={sync}"}
    result = subprocess.run(
        [
            "pgbench",
            "-n",
            "-M",
            "prepared",
            "-c",
            str(writers),
            "-j",
            "2",
            "-T",
            str(max(1, round(seconds))),
            "-f",
            str(script),
            url,
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    found = re.search(r"tps = ([0-9.]+)", result.stdout)
    if found is None:
        raise RuntimeError(f"pgbench printed no tps: {result.stdout}{result.stderr}")
    return float(found.group(1))


async def _phase(writers: list[asyncpg.Connection[Any]], seconds: float) -> float:
    started = time.perf_counter()
    counts = await asyncio.gather(*(_publish_for(w, started + seconds) for w in writers))
    return sum(counts) / (time.perf_counter() - started)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--writers", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--synchronous-commit", choices=["on", "off"], default="on")
    parser.add_argument("--drain-ms", type=float, default=5.0)
    parser.add_argument(
        "--client",
        choices=["pgbench", "asyncpg"],
        default="pgbench" if shutil.which("pgbench") else "asyncpg",
    )
    args = parser.parse_args()
    script = Path(tempfile.mkdtemp()) / "publish.sql"
    script.write_text(_pgbench_script())
    admin_url = os.environ.get("DATABASE_URL", RuntimeSettings().database_url)
    url = await _database(admin_url)
    notified = 0
    notifications: dict[str, int] = {}

    def count(*_: object) -> None:
        nonlocal notified
        notified += 1

    listener = await asyncpg.connect(url)
    admin = await asyncpg.connect(url)
    writers = [
        await asyncpg.connect(url, server_settings={"synchronous_commit": args.synchronous_commit})
        for _ in range(args.writers)
    ]
    modes = ("notify every commit", "doorbell", "no trigger")
    rates: dict[str, list[float]] = {mode: [] for mode in modes}
    notifications.update(dict.fromkeys(modes, 0))
    rang = asyncio.Event()
    try:

        def on_notify(*_: object) -> None:
            count()
            rang.set()

        await listener.add_listener("kb_outbox", on_notify)

        async def phase(seconds: float) -> float:
            if args.client == "asyncpg":
                return await _phase(writers, seconds)
            return await asyncio.to_thread(
                _pgbench_phase, url, script, args.writers, seconds, args.synchronous_commit
            )

        async def relay_like() -> None:
            while True:
                await rang.wait()
                rang.clear()
                await admin.execute("UPDATE relay_doorbell SET armed = false WHERE armed")
                await asyncio.sleep(args.drain_ms / 1000)
                await admin.execute("UPDATE relay_doorbell SET armed = true WHERE NOT armed")

        await phase(1.0)  # warm-up
        for _ in range(args.rounds):
            for mode in modes:
                action = "DISABLE" if mode == "no trigger" else "ENABLE"
                await admin.execute(f"ALTER TABLE outbox {action} TRIGGER {TRIGGER}")
                await admin.execute("UPDATE relay_doorbell SET armed = true")
                doorbell = asyncio.create_task(relay_like()) if mode == "doorbell" else None
                before = notified
                rates[mode].append(await phase(args.seconds))
                notifications[mode] += notified - before
                if doorbell is not None:
                    doorbell.cancel()
                    await asyncio.gather(doorbell, return_exceptions=True)
        await admin.execute(f"ALTER TABLE outbox ENABLE TRIGGER {TRIGGER}")
        await admin.execute("UPDATE relay_doorbell SET armed = true")
    finally:
        for conn in (*writers, listener, admin):
            await conn.close()
        admin_conn = await asyncpg.connect(admin_url)
        try:
            await admin_conn.execute(f'DROP DATABASE IF EXISTS "{BENCH_DB}" WITH (FORCE)')
        finally:
            await admin_conn.close()
    print(
        f"{args.writers} {args.client} writers, one outbox row per transaction, "
        f"synchronous_commit={args.synchronous_commit}, {args.rounds} x {args.seconds:.0f} s "
        f"per mode, relay drain {args.drain_ms} ms"
    )
    ceiling = statistics.median(rates["no trigger"])
    for mode, values in rates.items():
        shown = " ".join(f"{v:7.0f}" for v in values)
        median = statistics.median(values)
        print(
            f"  {mode:20} commits/s {shown}   median {median:7.0f}"
            f"  {median / ceiling:.2f}x no trigger  notifications {notifications[mode]}"
        )


if __name__ == "__main__":
    asyncio.run(main())
