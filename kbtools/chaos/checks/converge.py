"""When the system has converged: no task left to run and every document served at the
newest version indexed for its served generation. The run times it from the end of the
last fault, which is what a user waits for after an incident: until then, what was
published before is not all searchable at its newest version."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg

from kbtools.chaos.checks.queries import QUERIES
from kbtools.chaos.checks.result import CheckResult
from kbtools.chaos.rig.topology import ChaosStack


async def check_pointers(conn: asyncpg.Connection[Any], result: CheckResult) -> None:
    """Each served version is the newest version whose task succeeded in the pointer's own
    generation; a document with a succeeded task is served."""
    rows = await conn.fetch(QUERIES["pointers"])
    invariant = "pointer at newest indexed version"
    for row in rows:
        where = f"{row['tenant_id']}/{row['document_id']}"
        if row["deleted"]:
            continue  # expected gone, at a tombstone: removals.check_final
        if row["served"] is None:
            if row["newest_any"] is not None:
                result.violate(invariant, f"{where}: v{row['newest_any']} indexed, none served")
        elif row["newest"] is not None and row["served"] != row["newest"]:
            result.violate(
                invariant,
                f"{where}: serves v{row['served']} ({row['embedding_model']}), newest "
                f"indexed v{row['newest']}",
            )
    result.figures["documents"] = len(rows)
    result.figures["documents served"] = sum(
        r["served"] is not None and not r["deleted"] for r in rows
    )


async def settle(stack: ChaosStack, timeout_s: float) -> float | None:
    """Seconds until no task is left to run (None: still some after ``timeout_s``)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if await _left(stack, pointers=False) == 0:
            return time.monotonic() - started
        await asyncio.sleep(1)
    return None


async def converge(stack: ChaosStack, since: float, timeout_s: float) -> float | None:
    """Seconds from ``since`` (the monotonic moment the last fault ended) until every task
    created by then is settled and every pointer is current; None after ``timeout_s``.
    Tasks of later publishes are left out: the load may go on after the faults, and what
    is timed is the recovery from them, not the indexing of the newest publishes."""
    cutoff = datetime.now(UTC) - timedelta(seconds=time.monotonic() - since)
    while time.monotonic() - since < timeout_s:
        if await _left(stack, pointers=True, created_by=cutoff) == 0:
            return time.monotonic() - since
        await asyncio.sleep(0.5)
    return None


async def _left(stack: ChaosStack, *, pointers: bool, created_by: datetime | None = None) -> int:
    """Tasks left to run (and, with ``pointers``, documents not served at their newest
    indexed version); -1 while the database does not answer."""
    try:
        conn = await asyncpg.connect(stack.database_url, timeout=5)
        try:
            left = int(await conn.fetchval(QUERIES["live_tasks"], created_by))
            if pointers and left == 0:
                left = int(await conn.fetchval(QUERIES["not_current"]))
            return left
        finally:
            await conn.close()
    except (OSError, asyncpg.PostgresError):
        return -1


async def replica_caught_up(stack: ChaosStack, timeout_s: float) -> str | None:
    """None once the replica streams from the primary again and has replayed everything the
    primary had when asked (it must have reconnected by itself after the primary's
    restart); else what is wrong."""
    deadline = time.monotonic() + timeout_s
    problem = "never asked"
    while time.monotonic() < deadline:
        try:
            primary = await asyncpg.connect(stack.database_url, timeout=5)
            try:
                target = await primary.fetchval(QUERIES["wal_position"])
                state = await primary.fetchval(
                    QUERIES["replication_state"], stack.replica.application_name
                )
            finally:
                await primary.close()
            replica = await asyncpg.connect(stack.replica.url, timeout=5)
            try:
                behind = await replica.fetchval(QUERIES["replay_behind"], target)
            finally:
                await replica.close()
            if state == "streaming" and behind is not None and behind <= 0:
                return None
            problem = f"replica {state or 'not connected'}, {behind} bytes behind the primary"
        except (OSError, asyncpg.PostgresError) as error:
            problem = f"replica or primary not answering: {error!r}"[:200]
        await asyncio.sleep(0.5)
    return problem
