"""When the system has converged: no task left to run and every document served at the
newest version indexed for its served generation. The run times it from the end of the
last fault, which is what a user waits for after an incident: until then, what was
published before is not all searchable at its newest version."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta

import asyncpg

from kbtools.chaos.rig.topology import ChaosStack

# Each document's served version beside the newest version whose task succeeded, for the
# served model (newest; a task of no named generation builds the served one) and for any
# model (newest_any); a deleted document is served by its tombstone, not by a version (the
# checks of deletes judge it: kbtools/chaos/checks/removals.py). Hash joins and one aggregate:
# polled every half second while the run converges, over thousands of documents in the
# long run.
POINTERS_SQL = """
    WITH succeeded AS (
        SELECT t.tenant_id, t.document_id, g.embedding_model,
               max(t.version_number) AS newest
          FROM index_task t
          LEFT JOIN search_generation g ON g.generation_id = t.generation_id
         WHERE t.status = 'SUCCEEDED'
         GROUP BY 1, 2, 3)
    SELECT d.tenant_id, d.document_id, d.deleted_at IS NOT NULL AS deleted,
           s.version_number AS served, s.embedding_model,
           max(x.newest) FILTER (WHERE x.embedding_model IS NULL
                                    OR x.embedding_model = s.embedding_model) AS newest,
           max(x.newest) AS newest_any
      FROM document d
      LEFT JOIN document_search_version s
        ON s.tenant_id = d.tenant_id AND s.document_id = d.document_id
      LEFT JOIN succeeded x
        ON x.tenant_id = d.tenant_id AND x.document_id = d.document_id
     GROUP BY d.tenant_id, d.document_id, d.deleted_at, s.version_number, s.embedding_model
"""
_NOT_CURRENT_SQL = f"""
SELECT count(*) FROM ({POINTERS_SQL}) p
 WHERE NOT p.deleted
   AND ((p.served IS NULL AND p.newest_any IS NOT NULL)
        OR (p.newest IS NOT NULL AND p.served <> p.newest))
"""
_LIVE_TASKS_SQL = """
SELECT count(*) FROM index_task
 WHERE status IN ('PENDING', 'RUNNING', 'RETRY_WAIT')
   AND ($1::timestamptz IS NULL OR created_at <= $1)
"""


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
            left = int(await conn.fetchval(_LIVE_TASKS_SQL, created_by))
            if pointers and left == 0:
                left = int(await conn.fetchval(_NOT_CURRENT_SQL))
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
                target = await primary.fetchval("SELECT pg_current_wal_lsn()::text")
                state = await primary.fetchval(
                    "SELECT state FROM pg_stat_replication WHERE application_name = $1",
                    stack.replica.application_name,
                )
            finally:
                await primary.close()
            replica = await asyncpg.connect(stack.replica.url, timeout=5)
            try:
                behind = await replica.fetchval(
                    "SELECT pg_wal_lsn_diff($1::text::pg_lsn, pg_last_wal_replay_lsn())", target
                )
            finally:
                await replica.close()
            if state == "streaming" and behind is not None and behind <= 0:
                return None
            problem = f"replica {state or 'not connected'}, {behind} bytes behind the primary"
        except (OSError, asyncpg.PostgresError) as error:
            problem = f"replica or primary not answering: {error!r}"[:200]
        await asyncio.sleep(0.5)
    return problem
