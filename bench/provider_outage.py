"""A provider outage in the middle of a backfill: nothing dies, nothing is lost, search answers.

    uv run python -m bench.provider_outage --documents 1000 --outage-seconds 600

`kb serve` and ``--indexers`` `kb indexer run` processes (default settings: the breaker on,
no rate limit but ``--requests-per-second`` to pace the backfill so that it is still running
when the provider goes down) index ``--documents`` published through the bulk API. Once
``--outage-after`` of them are searchable, the test provider answers every request 503 for
``--outage-seconds``. A hybrid search runs every second all along.

Reported: tasks DEAD (target 0); attempts per task (target: at most one spent on the outage,
so at most 2 for any task); claims while the breaker was open against the requests the
provider saw in that time (its probes); seconds from the provider's recovery until every
document is searchable (target <= 60); searches answered, of them keyword-only, and failed
(target 0 failed).

Needs DATABASE_URL (or the dev stack). Not part of the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
from typing import Any

import asyncpg
import httpx

from bench.indexing_throughput import corpus
from bench.provider_fleet import TENANT, Fleet, attempts_spent, task_counts


class SearchLoop:
    """A hybrid search every second; counts answers, keyword-only answers and failures."""

    def __init__(self, base: str, key: str) -> None:
        self.base = base
        self.key = key
        self.answered = 0
        self.keyword_only = 0
        self.failed: list[str] = []
        self.stop = asyncio.Event()

    async def run(self) -> None:
        headers = {"Authorization": f"Bearer {self.key}"}
        body = {"query": "refund policy for damaged parcels", "principals": ["group:all"]}
        async with httpx.AsyncClient(base_url=self.base, headers=headers, timeout=30) as client:
            while not self.stop.is_set():
                try:
                    response = await client.post(f"/v1/tenants/{TENANT}/search", json=body)
                    if response.status_code == 200:
                        self.answered += 1
                        if response.json().get("degraded") == "keyword-only":
                            self.keyword_only += 1
                    else:
                        self.failed.append(f"{response.status_code} {response.text[:200]}")
                except httpx.HTTPError as error:
                    self.failed.append(repr(error))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stop.wait(), 1.0)


async def breaker_state(conn: asyncpg.Connection[Any]) -> str:
    state = await conn.fetchval("SELECT breaker_state FROM embedding_provider_state LIMIT 1")
    return str(state or "closed")


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    fleet = await Fleet.create("kb_bench_outage")
    searches: SearchLoop | None = None
    try:
        base = await fleet.start_api()
        searches = SearchLoop(base, fleet.key)
        search_task = asyncio.create_task(searches.run())
        await fleet.publish(base, corpus("documents", args.documents, seed=31))
        settings = {"KB_EMBEDDING_RATE_REQUESTS_PER_SECOND": str(args.requests_per_second)}
        for _ in range(args.indexers):
            await fleet.start_indexer(**settings)
        conn = await asyncpg.connect(fleet.url)
        try:
            while True:
                if (await task_counts(conn)).get("SUCCEEDED", 0) >= args.outage_after:
                    break
                await asyncio.sleep(0.1)
            fleet.provider.control.inject("status", status=503, for_seconds=args.outage_seconds)
            down_at = time.monotonic()
            requests_at_down = fleet.provider_requests()
            opened_at: float | None = None
            claims_at_open = requests_at_open = 0
            while time.monotonic() - down_at < args.outage_seconds:
                if opened_at is None and await breaker_state(conn) != "closed":
                    opened_at = time.monotonic()
                    claims_at_open = await attempts_spent(conn)
                    requests_at_open = fleet.provider_requests()
                await asyncio.sleep(0.2)
            up_at = time.monotonic()
            claims_at_up = await attempts_spent(conn)
            requests_at_up = fleet.provider_requests()
            during = await task_counts(conn)
            while True:
                counts = await task_counts(conn)
                if counts.get("SUCCEEDED", 0) + counts.get("DEAD", 0) >= args.documents:
                    break
                if time.monotonic() - up_at > args.limit_seconds:
                    break
                await asyncio.sleep(0.2)
            all_done_after = time.monotonic() - up_at
            searches.stop.set()
            await search_task
            attempts = await conn.fetch(
                "SELECT attempts, count(*) AS n FROM index_task GROUP BY attempts ORDER BY 1"
            )
            searchable = await conn.fetchval("SELECT count(*) FROM document_search_version")
        finally:
            await conn.close()
    finally:
        if searches is not None:
            searches.stop.set()
        await fleet.stop()
    return {
        "documents": args.documents,
        "outage_seconds": args.outage_seconds,
        "tasks_when_provider_recovered": during,
        "tasks_at_end": counts,
        "dead": counts.get("DEAD", 0),
        "searchable": searchable,
        "tasks_by_attempts": {row["attempts"]: row["n"] for row in attempts},
        "max_attempts": max(row["attempts"] for row in attempts),
        "breaker_opened_after_seconds": None if opened_at is None else opened_at - down_at,
        "requests_before_breaker_opened": requests_at_open - requests_at_down,
        "claims_while_open": claims_at_up - claims_at_open,
        "provider_requests_while_open": requests_at_up - requests_at_open,
        "searchable_seconds_after_recovery": all_done_after,
        "searches_answered": searches.answered if searches else 0,
        "searches_keyword_only": searches.keyword_only if searches else 0,
        "searches_failed": len(searches.failed) if searches else 0,
        "search_failures": (searches.failed[:5] if searches else []),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--documents", type=int, default=1000)
    parser.add_argument("--outage-seconds", type=float, default=600)
    parser.add_argument("--outage-after", type=int, default=100)
    parser.add_argument("--requests-per-second", type=float, default=4)
    parser.add_argument("--indexers", type=int, default=2)
    parser.add_argument("--limit-seconds", type=float, default=600)
    args = parser.parse_args()
    result = asyncio.run(measure(args))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
