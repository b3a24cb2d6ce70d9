"""How the offline model uses the cores: model runs at once, threads per run, requests at once.

Three settings combine (docs/configuration.md, ``onnx-local``):

- ``intra_op_threads``: onnxruntime threads inside one model run (default 1);
- ``runs_per_request``: model runs at once that share out one request's inputs;
- ``max_concurrent_inferences``: requests the process embeds at once (default 1).

At most ``intra_op_threads * runs_per_request * max_concurrent_inferences`` threads run the
model at once. Unset, ``runs_per_request`` fills the cores the process may use (its
affinity, capped by its cgroup's CPU quota) with what the other two leave, up to four: on
two cores, two one-thread runs at once. Two threads of one run wait for each other at every
step, so any other process's moment on a core stalls both; two one-thread runs lose only
the one (BENCHMARKS.md, "The offline default on two cores"). More than four runs mostly wait on
memory bandwidth, and the indexer's parse processes need cores too. With
``inference_batch_size`` above one, unset ``runs_per_request`` is one: a run's memory grows
with its inputs, and that setting used to mean one batch in memory at a time.

This module imports no runtime: the settings validate a combination with it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Final, TypeVar

from services.runtime.cpus import usable_cores

T = TypeVar("T")

MAX_AUTO_RUNS: Final = 4
# More model threads than this at once is a typo, not a plan (each setting alone is <= 64).
MAX_MODEL_THREADS: Final = 256


@dataclass(frozen=True)
class InferencePlan:
    """What the process runs: ``runs_per_request`` runs of ``intra_op_threads`` threads
    per request, ``max_concurrent_inferences`` requests at once."""

    intra_op_threads: int
    runs_per_request: int
    max_concurrent_inferences: int

    @property
    def model_threads(self) -> int:
        """The most threads running the model at once."""
        return self.intra_op_threads * self.runs_per_request * self.max_concurrent_inferences


def plan_inference(
    *,
    intra_op_threads: int = 1,
    runs_per_request: int | None = None,
    max_concurrent_inferences: int = 1,
    inference_batch_size: int = 1,
    cores: int | None = None,
) -> InferencePlan:
    """The plan the settings ask for; ``runs_per_request`` None: fill ``cores`` (the usable
    cores by default), or one run when a run takes several inputs. ValueError, naming the
    variables, for a plan that cannot run."""
    named = {
        "KB_EMBEDDING_INTRA_OP_THREADS": intra_op_threads,
        "KB_EMBEDDING_MAX_CONCURRENT_INFERENCES": max_concurrent_inferences,
        "KB_EMBEDDING_INFERENCE_BATCH_SIZE": inference_batch_size,
    }
    if runs_per_request is not None:
        named["KB_EMBEDDING_RUNS_PER_REQUEST"] = runs_per_request
    for name, value in named.items():
        if value < 1:
            raise ValueError(f"{name} must be at least 1, not {value}")
    if runs_per_request is None and inference_batch_size > 1:
        # Each run holds the activations of all its inputs: an operator who sized memory
        # for one batch at a time keeps one run at a time unless they ask for more.
        runs_per_request = 1
    if runs_per_request is None:
        available = usable_cores() if cores is None else cores
        per_run = intra_op_threads * max_concurrent_inferences
        runs_per_request = max(1, min(MAX_AUTO_RUNS, available // per_run))
    plan = InferencePlan(intra_op_threads, runs_per_request, max_concurrent_inferences)
    if plan.model_threads > MAX_MODEL_THREADS:
        raise ValueError(
            f"KB_EMBEDDING_INTRA_OP_THREADS ({intra_op_threads}) x "
            f"KB_EMBEDDING_RUNS_PER_REQUEST ({runs_per_request}) x "
            f"KB_EMBEDDING_MAX_CONCURRENT_INFERENCES ({max_concurrent_inferences}) is "
            f"{plan.model_threads} model threads at once, more than {MAX_MODEL_THREADS}"
        )
    return plan


class Lanes:
    """Shares out a list of work items between up to ``width`` threads at once, the calling
    thread among them: each lane takes the next item when it is done with one, so a lane
    that got long inputs does not hold the others up. Helper threads are kept between calls
    (``calls_at_once`` callers may share them) and stopped by ``close``.

    After ``close`` (a shutdown while requests are still embedding) every call still does
    all its work, in the caller's lane alone: a request in flight finishes rather than
    failing at the last moment, and no helper thread is started that nobody would stop."""

    def __init__(self, width: int, calls_at_once: int = 1) -> None:
        self.width = width
        self._helpers = (width - 1) * calls_at_once
        self._executor: ThreadPoolExecutor | None = None
        self._closed = False
        self._lock = threading.Lock()

    def run(self, work: Callable[[T], None], items: Sequence[T]) -> None:
        """``work`` on every item; the first error, once every lane has stopped."""
        lanes = min(self.width, len(items))
        if lanes <= 1:
            for item in items:
                work(item)
            return
        feed = iter(items)
        feed_lock = threading.Lock()
        errors: list[BaseException] = []

        def lane() -> None:
            while not errors:
                with feed_lock:
                    item = next(feed, _END)
                if item is _END:
                    return
                try:
                    work(item)  # type: ignore[arg-type]
                except BaseException as error:  # handed to the caller below
                    errors.append(error)
                    return

        helpers = self._start(lane, lanes - 1)
        lane()
        # Whatever was submitted runs to its end before ``run`` returns: no helper writes
        # into a result its caller has given up on.
        wait(helpers)
        if errors:
            raise errors[0]

    def _start(self, lane: Callable[[], None], count: int) -> list[Future[None]]:
        """Up to ``count`` helpers, submitted under the lock ``close`` takes, so none is
        handed a shut executor; none once closed."""
        helpers: list[Future[None]] = []
        with self._lock:
            if self._closed:
                return helpers
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self._helpers, thread_name_prefix="onnx-run")
            try:
                for _ in range(count):
                    helpers.append(self._executor.submit(lane))
            except RuntimeError:  # the interpreter is exiting: the caller's lane does the rest
                pass
        return helpers

    def close(self) -> None:
        with self._lock:
            self._closed = True
            executor, self._executor = self._executor, None
        if executor is not None:
            # Helpers already submitted finish their call (its caller waits for them); then
            # the threads end.
            executor.shutdown(wait=False)


_END: Final = object()
