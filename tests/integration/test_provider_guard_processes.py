"""The shared guard across two OS processes: each its own pool and ProviderGuard on the same
PostgreSQL database, each sending real HTTP requests to the fault-injecting test provider
(served in this test's process). The limiter spaces their combined requests, a 429 pauses
both, the breaker opens, probes once and closes for both.

The child side is this module run as ``python -m tests.integration.test_provider_guard_processes``:
it reads one JSON command per line on stdin and answers one JSON line on stdout.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from services.embedding.guard.breaker import BreakerState
from services.runtime.indexing.index_failures import ErrorCode
from tests.support.embedding_provider import EmbeddingProvider, ServedProvider, served_provider
from tests.support.stack import REPO_ROOT

pytestmark = pytest.mark.integration

MODEL = "test-embed"
DIMENSION = 8
# 20 requests/s in all, indexing 80 % of it: 16/s, one per 62.5 ms (whole microseconds).
RATE = 20
INDEX_PERIOD = 1 / (RATE * 0.8)


# --- the child process ------------------------------------------------------------------------


async def _child_main() -> None:
    from services.embedding.factory import build_embedder
    from services.embedding.guard.factory import build_guard
    from services.embedding.guard.guarded import GuardedEmbedder
    from services.embedding.guard.quota import Charge, Purpose, Reservation
    from services.embedding.guard.store_pg import PgProviderStateStore
    from services.embedding.port import Vectors
    from services.embedding.settings import load_embedding_settings
    from services.runtime.indexing.index_failures import IndexingFailed
    from services.runtime.logging import configure_logging
    from services.runtime.pg.db import create_pool
    from services.runtime.settings import RuntimeSettings

    configure_logging("warning")  # logs to stderr: stdout is the protocol
    owner = os.environ["TEST_GUARD_OWNER"]
    offset = timedelta()

    class OffsetClock:
        """``local``: this machine's time plus what the test advanced (both children are
        advanced alike); otherwise the database's clock, as in production."""

        def now(self) -> datetime | None:
            if os.environ.get("TEST_GUARD_CLOCK") != "local":
                return None
            return datetime.now(UTC) + offset

    reservations: list[dict[str, Any]] = []

    class RecordingStore(PgProviderStateStore):
        async def reserve(
            self, provider: str, charges: Sequence[Charge], *, max_wait_seconds: float
        ) -> Reservation:
            done = await super().reserve(provider, charges, max_wait_seconds=max_wait_seconds)
            reservations.append({"send_at": done.send_at.isoformat(), "granted": done.granted})
            return done

    settings = load_embedding_settings()
    pool = await create_pool(RuntimeSettings(), min_size=1, max_size=4)
    guard = build_guard(settings, RecordingStore(pool, clock=OffsetClock()), owner)
    inner = build_embedder(settings)
    sent: list[float] = []
    inner_embed = inner.embed

    async def recording_embed(texts: Sequence[str]) -> Vectors:
        sent.append(time.time())
        return await inner_embed(texts)

    inner.embed = recording_embed  # type: ignore[method-assign]
    embedder = GuardedEmbedder(inner, guard, purpose=Purpose.INDEX, owner=owner)

    async def one(index: int) -> str:
        try:
            await embedder.embed([f"{owner} text {index}"])
        except IndexingFailed as error:
            return error.code
        return "ok"

    async def embed(count: int, concurrency: int) -> list[str]:
        gate = asyncio.Semaphore(concurrency)

        async def bounded(index: int) -> str:
            async with gate:
                return await one(index)

        return list(await asyncio.gather(*(bounded(i) for i in range(count))))

    reader = asyncio.StreamReader()
    loop = asyncio.get_running_loop()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    print(json.dumps({"ready": owner}), flush=True)
    while line := await reader.readline():
        command = json.loads(line)
        answer: dict[str, Any] = {}
        if command["op"] == "embed":
            reservations.clear()
            sent.clear()
            answer["results"] = await embed(command["count"], command["concurrency"])
            answer["reservations"] = list(reservations)
            answer["sent"] = list(sent)
        elif command["op"] == "claim":
            allowance = await guard.claim_allowance(command["owner"])
            answer.update(
                limit=allowance.limit, retry_in=allowance.retry_in_seconds, reason=allowance.reason
            )
        elif command["op"] == "view":
            view = await guard.view()
            answer.update(
                state=str(view.state),
                failures=view.consecutive_failures,
                now=view.now.isoformat(),
                paused_until=view.paused_until and view.paused_until.isoformat(),
                open_until=view.open_until and view.open_until.isoformat(),
                probe_owner=view.probe_owner,
            )
        elif command["op"] == "advance":
            offset += timedelta(seconds=command["seconds"])
        elif command["op"] == "exit":
            break
        print(json.dumps(answer), flush=True)
    await embedder.aclose()
    await pool.close()


# --- the test's side ----------------------------------------------------------------------------


class Child:
    def __init__(self, process: asyncio.subprocess.Process, owner: str) -> None:
        self.process = process
        self.owner = owner

    async def call(self, op: str, **fields: Any) -> dict[str, Any]:
        assert self.process.stdin is not None
        assert self.process.stdout is not None
        self.process.stdin.write(json.dumps({"op": op, **fields}).encode() + b"\n")
        await self.process.stdin.drain()
        async with asyncio.timeout(60):
            line = await self.process.stdout.readline()
        assert line, f"child {self.owner} exited (code {self.process.returncode})"
        answer: dict[str, Any] = json.loads(line)
        return answer

    async def embed(self, count: int = 1, concurrency: int = 1) -> dict[str, Any]:
        return await self.call("embed", count=count, concurrency=concurrency)

    async def results(self, count: int = 1) -> list[str]:
        answer = await self.embed(count)
        results: list[str] = answer["results"]
        return results


async def start_child(env: dict[str, str], owner: str) -> Child:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.integration.test_provider_guard_processes",
        cwd=REPO_ROOT,
        env={**env, "TEST_GUARD_OWNER": owner},
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert process.stdout is not None
    async with asyncio.timeout(60):
        ready = await process.stdout.readline()
    assert json.loads(ready) == {"ready": owner}
    return Child(process, owner)


@pytest.fixture
def provider() -> Iterator[ServedProvider]:
    with served_provider(EmbeddingProvider(dimension=DIMENSION)) as served:
        yield served


def child_env(database_url: str, served: ServedProvider, **settings: object) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KB_", "TEST_GUARD_"))}
    env.update(
        DATABASE_URL=database_url,
        KB_EMBEDDING_PROVIDER="openai",
        KB_EMBEDDING_BASE_URL=served.base_url,
        KB_EMBEDDING_MODEL=MODEL,
        KB_EMBEDDING_DIMENSIONS=str(DIMENSION),
        KB_EMBEDDING_TIMEOUT_SECONDS="10",
    )
    env.update({f"KB_EMBEDDING_{name.upper()}": str(value) for name, value in settings.items()})
    return env


Spawn = Callable[..., Awaitable[list[Child]]]


@pytest.fixture
async def spawn(database_url: str, provider: ServedProvider) -> AsyncIterator[Spawn]:
    """Starts the two children, A and B, with the guard settings given."""
    started: list[Child] = []

    async def start(clock: str = "database", **settings: object) -> list[Child]:
        env = {**child_env(database_url, provider, **settings), "TEST_GUARD_CLOCK": clock}
        pair = await asyncio.gather(start_child(env, "proc-a"), start_child(env, "proc-b"))
        started.extend(pair)
        return list(pair)

    yield start
    for child in started:
        if child.process.returncode is None:
            child.process.terminate()
            await child.process.wait()


def instants(values: Sequence[str]) -> list[datetime]:
    return sorted(datetime.fromisoformat(value) for value in values)


def limiter_settings(**extra: object) -> dict[str, object]:
    return {
        "rate_requests_per_second": RATE,
        "rate_query_reserve": 0.2,
        "rate_burst_seconds": 0.05,  # a burst of one request
        **extra,
    }


async def test_two_processes_share_one_request_rate(spawn: Spawn, provider: ServedProvider) -> None:
    a, b = await spawn(**limiter_settings())
    per_child = 16
    answers = await asyncio.gather(a.embed(per_child, 4), b.embed(per_child, 4))
    assert all(result == "ok" for answer in answers for result in answer["results"])
    assert len(provider.provider.requests) == 2 * per_child

    # Counts, not timings: every reservation has a slot of its own, one indexing period
    # from the one before, whichever process took it.
    slots = instants([r["send_at"] for answer in answers for r in answer["reservations"]])
    assert len(slots) == 2 * per_child
    gaps = [(later - earlier).total_seconds() for earlier, later in itertools.pairwise(slots)]
    assert min(gaps) >= INDEX_PERIOD - 1e-6
    # Both processes took turns in the same stretch of slots.
    spans = [instants([r["send_at"] for r in answer["reservations"]]) for answer in answers]
    assert max(span[0] for span in spans) < min(span[-1] for span in spans)

    # And the provider saw that rate: in any second, at most the rate and one burst.
    sent = sorted(t for answer in answers for t in answer["sent"])
    window = 1.0
    busiest = max(sum(1 for t in sent if start <= t < start + window) for start in sent)
    assert busiest <= window / INDEX_PERIOD + 2
    assert sent[-1] - sent[0] >= 0.9 * (len(sent) - 1) * INDEX_PERIOD


async def test_a_retry_after_pauses_both_processes(spawn: Spawn, provider: ServedProvider) -> None:
    a, b = await spawn(**limiter_settings())
    await a.embed()  # the buckets and the state row exist
    provider.provider.clear_requests()
    provider.provider.inject("rate_limit", times=1, retry_after="2")

    assert await a.results() == [ErrorCode.EMBEDDING_RATE_LIMITED]
    view = await b.call("view")
    paused_until = datetime.fromisoformat(view["paused_until"])
    assert paused_until - datetime.fromisoformat(view["now"]) > timedelta(seconds=1.5)
    claim = await b.call("claim", owner="worker-b")
    assert (claim["limit"], claim["reason"]) == (0, "paused")

    answers = await asyncio.gather(a.embed(3, 3), b.embed(3, 3))
    assert [r for answer in answers for r in answer["results"]] == ["ok"] * 6
    slots = instants([r["send_at"] for answer in answers for r in answer["reservations"]])
    # Nothing before the pause ended, then one period apart: no herd at its end.
    assert slots[0] >= paused_until + timedelta(seconds=INDEX_PERIOD) - timedelta(microseconds=1)
    gaps = [(later - earlier).total_seconds() for earlier, later in itertools.pairwise(slots)]
    assert min(gaps) >= INDEX_PERIOD - 1e-6
    sent = [t for answer in answers for t in answer["sent"]]
    assert min(sent) >= paused_until.timestamp() - 0.05  # the same machine's clock
    # The provider saw the 429 and the six requests after the pause, nothing between.
    assert [r.fault for r in provider.provider.requests] == ["rate_limit"] + [None] * 6


async def test_the_breaker_opens_probes_and_closes_across_processes(
    spawn: Spawn, provider: ServedProvider
) -> None:
    a, b = await spawn(
        breaker_failure_threshold=2,
        breaker_open_seconds=10,
        breaker_max_open_seconds=100,
        breaker_probe_seconds=30,
        guard_refresh_seconds=0,
        clock="local",
    )
    served = provider.provider
    unavailable = ErrorCode.EMBEDDING_UNAVAILABLE

    async def advance(seconds: float) -> None:
        await asyncio.gather(*(c.call("advance", seconds=seconds) for c in (a, b)))

    # One failure in each process: two consecutive failures of the provider, shared.
    served.inject("status", status=503, times=2)
    assert await a.results() == [unavailable]
    assert await b.results() == [unavailable]
    view = await a.call("view")
    assert (view["state"], view["failures"]) == (BreakerState.OPEN, 2)
    # Open: neither process sends, nor claims.
    assert await a.results() == [unavailable]
    assert await b.results() == [unavailable]
    assert len(served.requests) == 2
    for child in (a, b):
        claim = await child.call("claim", owner=f"worker-{child.owner}")
        assert (claim["limit"], claim["reason"]) == (0, "breaker_open")

    # Due: one claim wins the probe; the other process neither claims nor sends.
    await advance(10)
    assert (await a.call("claim", owner="worker-a"))["limit"] == 1
    assert (await b.call("claim", owner="worker-b"))["limit"] == 0
    assert await b.results() == [unavailable]
    assert len(served.requests) == 2

    # The probe fails: open again, for twice as long.
    served.inject("status", status=503, times=1)
    assert await a.results() == [unavailable]
    assert len(served.requests) == 3
    view = await b.call("view")
    assert view["state"] == BreakerState.OPEN
    reopened_for = datetime.fromisoformat(view["open_until"]) - datetime.fromisoformat(view["now"])
    assert timedelta(seconds=19) < reopened_for <= timedelta(seconds=20)
    await advance(10)
    assert (await b.call("claim", owner="worker-b"))["reason"] == "breaker_open"

    # Due again: B probes, the provider answers, the breaker closes for both.
    await advance(10)
    assert (await b.call("claim", owner="worker-b"))["limit"] == 1
    assert (await a.call("claim", owner="worker-a"))["limit"] == 0
    assert await b.results() == ["ok"]
    assert (await a.call("view"))["state"] == BreakerState.CLOSED
    assert await a.results(2) == ["ok", "ok"]
    assert (await a.call("claim", owner="worker-a"))["limit"] is None
    assert len(served.requests) == 6

    # A probe's owner that vanishes (its process killed) holds the probe for probe_seconds.
    served.inject("status", status=503, times=2)
    assert await a.results(2) == [unavailable] * 2
    await advance(10)
    assert (await a.call("claim", owner="worker-a"))["limit"] == 1
    a.process.kill()
    await a.process.wait()
    assert (await b.call("claim", owner="worker-b"))["reason"] == "probing"
    await b.call("advance", seconds=30)
    assert (await b.call("claim", owner="worker-b"))["limit"] == 1
    assert await b.results() == ["ok"]
    assert (await b.call("view"))["state"] == BreakerState.CLOSED


if __name__ == "__main__":
    asyncio.run(_child_main())
