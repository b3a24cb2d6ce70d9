"""How the search benchmarks time a call and what a row of their tables holds, shared by
the in-process rows (``search_scale_measure``), the HTTP rows (``search_scale_http``), the
row-security and the replica benches. Apart from all of them: the measure runs the HTTP
rows, so the HTTP rows cannot take their timing from the measure without an import circle."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

TOP_K = 10
WARM_UP = 10


@dataclass
class Row:
    name: str
    principals: str
    concurrency: int
    samples: list[float]
    per_second: float
    recall: float | None = None
    filled: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # The plain tenant query's milliseconds for the same queries, each run right after the
    # row's own call (the ratio's base: the machine's drift between rows cancels out).
    paired: list[float] | None = None


def percentile(samples: Sequence[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def timed(
    call: Callable[[int], Awaitable[Any]],
    count: int,
    concurrency: int,
    peer: Callable[[int], Awaitable[Any]] | None = None,
) -> tuple[list[float], list[Any], float, list[float]]:
    """``count`` calls, ``concurrency`` at a time (after ``WARM_UP`` untimed ones): each
    call's milliseconds, its answer, calls per second over the whole run, and -- with
    ``peer`` -- the peer's milliseconds for the same query, run by the same worker beside
    each call (calls per second are then the workers' busy rate, by Little's law:
    concurrency over the mean call time)."""
    for n in range(min(WARM_UP, count)):
        await call(n)
    samples = [0.0] * count
    peer_samples = [0.0] * count if peer is not None else []
    answers: list[Any] = [None] * count
    todo = iter(range(count))

    async def run(n: int) -> None:
        started = time.perf_counter()
        answers[n] = await call(n)
        samples[n] = (time.perf_counter() - started) * 1000

    async def run_peer(n: int) -> None:
        if peer is not None:
            started = time.perf_counter()
            await peer(n)
            peer_samples[n] = (time.perf_counter() - started) * 1000

    async def worker() -> None:
        for n in todo:  # one iterator shared by the workers: each call runs once
            # Every other query runs the peer first: whichever runs second finds the
            # query's part of the graph in the CPU's caches.
            first, second = (run_peer, run) if n % 2 else (run, run_peer)
            await first(n)
            await second(n)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    if peer is not None:
        return samples, answers, concurrency * 1000 / statistics.mean(samples), peer_samples
    return samples, answers, count / (time.perf_counter() - started), peer_samples
