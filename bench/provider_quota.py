"""A provider quota shared by a fleet: with the shared limiter and without it, same run.

    uv run python -m bench.provider_quota --requests-per-minute 120 --tokens-per-minute 150000

The test provider (a process) meters requests and tokens per minute as a hosted provider
does and answers 429 with Retry-After beyond its quota. Two `kb indexer run` processes of
``--concurrency`` slots each (8 workers in 2 processes by default) index a backlog far
larger than the quota allows in ``--seconds``. Once without any rate setting (each 429
pauses the fleet through the shared Retry-After, nothing more), once with
``KB_EMBEDDING_RATE_REQUESTS_PER_SECOND`` and ``KB_EMBEDDING_RATE_TOKENS_PER_MINUTE`` set to
``--margin`` (97%) of the quota, as an operator sets them: a limiter at exactly the quota
sends each request the moment the provider's bucket refills, and the smallest delay on the
wire makes it early. Reported per phase: the share of the quota used (requests and tokens answered
200 against what the quota allows in the phase's time; the binding one counts) and the
share of requests answered 429. Targets: >= 90% of the quota, < 1% 429 with the limiter.

Needs DATABASE_URL (or the dev stack). Not part of the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import asyncpg

from bench.indexing_throughput import corpus
from bench.provider_fleet import Fleet, task_counts
from tests.support.embedding_provider import Quota


async def phase(args: argparse.Namespace, limited: bool) -> dict[str, Any]:
    fleet = await Fleet.create(f"kb_bench_quota_{'limited' if limited else 'free'}")
    try:
        base = await fleet.start_api()
        await fleet.publish(base, corpus("notes", args.documents, seed=21))
        settings = {
            "KB_INDEXER_CONCURRENCY": str(args.concurrency),
            "KB_EMBEDDING_BATCH_SIZE": str(args.batch_size),
        }
        if limited:
            settings["KB_EMBEDDING_RATE_REQUESTS_PER_SECOND"] = str(
                args.margin * args.requests_per_minute / 60
            )
            settings["KB_EMBEDDING_RATE_TOKENS_PER_MINUTE"] = str(
                args.margin * args.tokens_per_minute
            )
        fleet.provider.control.set_quota(
            Quota(
                requests_per_minute=args.requests_per_minute,
                tokens_per_minute=args.tokens_per_minute,
                burst_seconds=args.burst_seconds,
            )
        )
        began = time.monotonic()
        for _ in range(args.processes):
            await fleet.start_indexer(**settings)
        await asyncio.sleep(args.seconds)
        stats = fleet.provider.control.stats()
        elapsed = time.monotonic() - began
        conn = await asyncpg.connect(fleet.url)
        try:
            counts = await task_counts(conn)
        finally:
            await conn.close()
    finally:
        await fleet.stop()
    answered = stats["answered"]
    ok = answered.get("200", 0)
    limited_answers = answered.get("429", 0)
    total = sum(answered.values())
    minutes = elapsed / 60
    request_share = ok / (args.requests_per_minute * minutes)
    token_share = stats["tokens_answered"] / (args.tokens_per_minute * minutes)
    return {
        "limiter": limited,
        "seconds": round(elapsed, 1),
        "requests": total,
        "requests_ok": ok,
        "requests_429": limited_answers,
        "share_429": limited_answers / total if total else 0.0,
        "tokens_ok": stats["tokens_answered"],
        "share_of_request_quota": request_share,
        "share_of_token_quota": token_share,
        "share_of_quota": max(request_share, token_share),
        "tasks": counts,
    }


async def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    return [await phase(args, limited=False), await phase(args, limited=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests-per-minute", type=float, default=120)
    parser.add_argument("--tokens-per-minute", type=float, default=150_000)
    parser.add_argument("--margin", type=float, default=0.97)
    parser.add_argument("--burst-seconds", type=float, default=1.0)
    parser.add_argument("--seconds", type=float, default=90)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--documents", type=int, default=2000)
    args = parser.parse_args()
    results = asyncio.run(measure(args))
    print("| limiter | requests | 200 | 429 | 429 share | share of quota (requests, tokens) |")
    print("|---|---|---|---|---|---|")
    for row in results:
        print(
            f"| {'shared' if row['limiter'] else 'none'} | {row['requests']} | "
            f"{row['requests_ok']} | {row['requests_429']} | {row['share_429']:.1%} | "
            f"{row['share_of_quota']:.0%} ({row['share_of_request_quota']:.0%}, "
            f"{row['share_of_token_quota']:.0%}) |"
        )
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
