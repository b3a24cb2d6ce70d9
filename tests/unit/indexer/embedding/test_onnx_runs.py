"""Sharing a request's inputs between model runs at once, with a session that records its
calls (no model): which thread ran what, and that every row comes back to its input."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tokenizers import Tokenizer

from services.embedding.onnx_local import MAX_SEQ_LENGTH, ModelRuns, default_tokenizer_file
from services.embedding.onnx_runs import MAX_MODEL_THREADS, Lanes, plan_inference
from services.runtime.cpus import cgroup_cpu_quota, usable_cores

# A fake hidden state per token id: the pooled vector tells which text a row came from.
TABLE = np.random.default_rng(5).standard_normal((97, 384)).astype(np.float32)


class RecordingSession:
    """onnxruntime's ``run``, answering from TABLE; its first ``meet`` calls wait for each
    other, so they pass only if that many runs are under way at once."""

    def __init__(self, meet: int = 1) -> None:
        self.calls: list[tuple[str, tuple[int, int]]] = []
        self._meeting = threading.Barrier(meet, timeout=30) if meet > 1 else None
        self._meet = meet
        self._lock = threading.Lock()

    def run(self, outputs: list[str], feeds: dict[str, Any]) -> list[Any]:
        ids = feeds["input_ids"]
        with self._lock:
            self.calls.append((threading.current_thread().name, ids.shape))
            first = len(self.calls) <= self._meet
        if self._meeting is not None and first:
            self._meeting.wait()
        return [TABLE[ids % len(TABLE)]]


def tokenizer() -> Tokenizer:
    loaded = Tokenizer.from_file(str(default_tokenizer_file()))
    loaded.no_padding()
    loaded.enable_truncation(max_length=MAX_SEQ_LENGTH)
    return loaded


def expected(texts: list[str]) -> Any:
    rows = []
    for text in texts:
        pooled = TABLE[np.array(tokenizer().encode(text).ids) % len(TABLE)].mean(axis=0)
        rows.append(pooled / np.linalg.norm(pooled))
    return np.vstack(rows)


TEXTS = [
    "tail " * 300,
    "ok",
    "a much longer sentence about shipping and returns " * 4,
    "refund",
    "Items can be returned within 30 days",
    "x",
    "the warehouse " * 40,
]


def test_one_request_is_shared_out_between_runs_at_once() -> None:
    session = RecordingSession(meet=2)
    lanes = Lanes(2)
    try:
        vectors = ModelRuns(session, tokenizer()).embed(TEXTS, 1, lanes)
    finally:
        lanes.close()
    # The first two runs met: two were under way at once, on two threads.
    assert len({thread for thread, _ in session.calls}) == 2
    assert len(session.calls) == len(TEXTS)
    np.testing.assert_allclose(vectors, expected(TEXTS), atol=1e-5)


@pytest.mark.parametrize(("runs", "sub_batch"), [(1, 1), (2, 1), (3, 2), (4, 3), (9, 1)])
def test_rows_come_back_in_the_inputs_order_whatever_the_split(runs: int, sub_batch: int) -> None:
    session = RecordingSession()
    lanes = Lanes(runs)
    try:
        vectors = ModelRuns(session, tokenizer()).embed(TEXTS, sub_batch, lanes)
    finally:
        lanes.close()
    np.testing.assert_allclose(vectors, expected(TEXTS), atol=1e-5)
    # Sorted by length first: the runs' widths rise, so each sub-batch pads little.
    widths = [shape[1] for _, shape in session.calls]
    assert sorted(widths) == sorted(
        max(len(tokenizer().encode(TEXTS[row]).ids) for row in rows)
        for rows in _length_sorted_batches(TEXTS, sub_batch)
    )


def _length_sorted_batches(texts: list[str], size: int) -> list[list[int]]:
    lengths = [len(tokenizer().encode(text).ids) for text in texts]
    order = sorted(range(len(texts)), key=lengths.__getitem__)
    return [order[start : start + size] for start in range(0, len(order), size)]


def test_a_failed_run_fails_the_request_and_stops_the_other_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    caller_inside, helper_done = threading.Event(), threading.Event()

    class SignallingExecutor(ThreadPoolExecutor):
        """Says when a helper's lane has ended: its error is recorded by then."""

        def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
            def lane() -> None:
                try:
                    fn(*args, **kwargs)
                finally:
                    helper_done.set()

            return super().submit(lane)

    class FailingHelperSession(RecordingSession):
        """Fails in the helper's lane while the caller's lane is inside a run; that run
        ends only once the helper's lane has ended, so the caller's lane looks for its next
        item after the failure, however the threads are scheduled."""

        def run(self, outputs: list[str], feeds: dict[str, Any]) -> list[Any]:
            answer = super().run(outputs, feeds)
            if threading.current_thread().name.startswith("onnx-run_"):
                assert caller_inside.wait(timeout=30)
                raise RuntimeError("the run failed")
            caller_inside.set()
            assert helper_done.wait(timeout=30)
            return answer

    monkeypatch.setattr("services.embedding.onnx_runs.ThreadPoolExecutor", SignallingExecutor)
    session = FailingHelperSession()
    lanes = Lanes(2)
    try:
        with pytest.raises(RuntimeError, match="the run failed"):
            ModelRuns(session, tokenizer()).embed(TEXTS, 1, lanes)
    finally:
        lanes.close()
    # One run a lane: the helper's failed, and the caller's lane took nothing after it.
    threads = sorted(thread.split("_")[0] for thread, _ in session.calls)
    assert threads == ["MainThread", "onnx-run"]


@pytest.mark.parametrize(
    ("settings", "cores", "plan"),
    [
        ({}, 1, (1, 1, 1)),
        ({}, 2, (1, 2, 1)),
        ({}, 3, (1, 3, 1)),
        ({}, 64, (1, 4, 1)),
        # The former default, set explicitly: one run of two threads on two cores.
        ({"intra_op_threads": 2}, 2, (2, 1, 1)),
        ({"intra_op_threads": 2}, 8, (2, 4, 1)),
        ({"max_concurrent_inferences": 2}, 4, (1, 2, 2)),
        ({"intra_op_threads": 4}, 2, (4, 1, 1)),
        # Set, it is what runs, whatever the cores.
        ({"runs_per_request": 3}, 1, (1, 3, 1)),
        ({"runs_per_request": 1}, 16, (1, 1, 1)),
        # Several inputs a run: one run at a time (memory), unless runs are asked for.
        ({"inference_batch_size": 16}, 8, (1, 1, 1)),
        ({"inference_batch_size": 2}, 2, (1, 1, 1)),
        ({"inference_batch_size": 16, "runs_per_request": 3}, 8, (1, 3, 1)),
    ],
)
def test_the_plan_fills_the_cores_with_what_is_not_set(
    settings: dict[str, int], cores: int, plan: tuple[int, int, int]
) -> None:
    made = plan_inference(cores=cores, **settings)
    assert (made.intra_op_threads, made.runs_per_request, made.max_concurrent_inferences) == plan


def test_the_cores_are_those_the_process_may_use(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr("services.runtime.cpus.CGROUP_ROOT", tmp_path)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {3}, raising=False)
    assert plan_inference().runs_per_request == 1
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 5, 6}, raising=False)
    assert plan_inference().runs_per_request == 3


@pytest.mark.parametrize(
    ("settings", "names"),
    [
        ({"intra_op_threads": 0}, ["KB_EMBEDDING_INTRA_OP_THREADS"]),
        ({"runs_per_request": 0}, ["KB_EMBEDDING_RUNS_PER_REQUEST"]),
        ({"max_concurrent_inferences": -1}, ["KB_EMBEDDING_MAX_CONCURRENT_INFERENCES"]),
        ({"inference_batch_size": 0}, ["KB_EMBEDDING_INFERENCE_BATCH_SIZE"]),
        (
            {"intra_op_threads": 16, "runs_per_request": 4, "max_concurrent_inferences": 8},
            ["512 model threads", "KB_EMBEDDING_RUNS_PER_REQUEST (4)"],
        ),
    ],
)
def test_a_plan_that_cannot_run_is_refused_by_name(
    settings: dict[str, int], names: list[str]
) -> None:
    with pytest.raises(ValueError, match="KB_EMBEDDING_") as caught:
        plan_inference(cores=2, **settings)
    for name in names:
        assert name in str(caught.value)


def test_the_docs_warn_of_a_combination_the_ceiling_now_refuses() -> None:
    # Each setting alone is within its bounds; only the product crosses the ceiling.
    docs = (Path(__file__).resolve().parents[4] / "docs" / "configuration.md").read_text()
    example = "KB_EMBEDDING_INTRA_OP_THREADS=16 KB_EMBEDDING_MAX_CONCURRENT_INFERENCES=32"
    assert f"`{example}`" in docs
    assert f"ceiling of {MAX_MODEL_THREADS} model threads" in docs
    with pytest.raises(ValueError, match="KB_EMBEDDING_MAX_CONCURRENT_INFERENCES \\(32\\)"):
        plan_inference(intra_op_threads=16, max_concurrent_inferences=32, cores=2)


def fake_root(tmp_path: Path, files: dict[str, str | bytes]) -> Path:
    """A folder holding ``proc/self/cgroup`` and ``sys/fs/cgroup/...`` as a host would."""
    for name, content in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
    return tmp_path


V2 = "sys/fs/cgroup"
V1 = "sys/fs/cgroup/cpu,cpuacct"


@pytest.mark.parametrize(
    ("files", "cpus"),
    [
        # cgroup v2, the process's own cgroup (Kubernetes limits.cpu: 2).
        (
            {
                "proc/self/cgroup": "0::/kubepods/pod1/app\n",
                f"{V2}/kubepods/pod1/app/cpu.max": "200000 100000\n",
                f"{V2}/kubepods/cpu.max": "max 100000\n",
            },
            2,
        ),
        # v2, a container that sees its own cgroup as the mount root; 1.5 CPUs round up.
        ({"proc/self/cgroup": "0::/\n", f"{V2}/cpu.max": "150000 100000\n"}, 2),
        # v2, a parent's quota binds its children.
        (
            {
                "proc/self/cgroup": "0::/a/b\n",
                f"{V2}/a/b/cpu.max": "max 100000\n",
                f"{V2}/a/cpu.max": "100000 100000\n",
            },
            1,
        ),
        # Half a CPU is still one core to run on.
        ({f"{V2}/cpu.max": "50000 100000"}, 1),
        ({"proc/self/cgroup": "0::/\n", f"{V2}/cpu.max": "max 100000\n"}, None),
        # cgroup v1 (docker --cpus=3): the host path in /proc is not mounted in the container.
        (
            {
                "proc/self/cgroup": "4:memory:/docker/c1\n3:cpu,cpuacct:/docker/c1\n0::/\n",
                f"{V1}/cpu.cfs_quota_us": "300000\n",
                f"{V1}/cpu.cfs_period_us": "100000\n",
            },
            3,
        ),
        (
            {
                "proc/self/cgroup": "3:cpu,cpuacct:/\n",
                f"{V1}/cpu.cfs_quota_us": "-1\n",
                f"{V1}/cpu.cfs_period_us": "100000\n",
            },
            None,
        ),
        # No cgroup files at all, or garbage: no quota.
        ({}, None),
        ({"proc/self/cgroup": "0::/\n"}, None),
        ({f"{V2}/cpu.max": "lots 100000"}, None),
        ({f"{V2}/cpu.max": "200000"}, None),
        ({f"{V2}/cpu.max": b"\xff\xfe"}, None),
        ({f"{V1}/cpu.cfs_quota_us": "200000"}, None),
        ({"proc/self/cgroup": b"\xff:::", f"{V2}/cpu.max": "100000 100000"}, 1),
        # Outside its cgroup namespace's root the kernel writes a path with "..": not a
        # folder under the mount, and never the quota of one outside it.
        (
            {
                "proc/self/cgroup": "0::/../sib/x\n",
                f"{V2}/cpu.max": "max 100000\n",
                "sys/fs/sib/x/cpu.max": "100000 100000\n",
                "sys/fs/sib/cpu.max": "100000 100000\n",
                "sys/fs/cpu.max": "100000 100000\n",
            },
            None,
        ),
    ],
)
def test_the_cgroup_quota_is_read_from_v1_and_v2_files(
    tmp_path: Path, files: dict[str, str | bytes], cpus: int | None
) -> None:
    assert cgroup_cpu_quota(fake_root(tmp_path, files)) == cpus


def test_a_cpu_quota_caps_the_cores_the_affinity_shows(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # A pod limited to 2 CPUs on a 16-core node: its affinity is all 16 cores.
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)), raising=False)
    root = fake_root(tmp_path, {"proc/self/cgroup": "0::/\n", f"{V2}/cpu.max": "200000 100000"})
    monkeypatch.setattr("services.runtime.cpus.CGROUP_ROOT", root)
    assert usable_cores() == 2
    assert plan_inference().runs_per_request == 2
    # A quota above the affinity changes nothing: the cpuset is the tighter bound.
    (root / V2 / "cpu.max").write_text("3200000 100000")
    assert usable_cores() == 16


class GatedSession(RecordingSession):
    """Its first run says it is under way (``inside``) and waits for ``go``."""

    def __init__(self) -> None:
        super().__init__()
        self.inside = threading.Event()
        self.go = threading.Event()

    def run(self, outputs: list[str], feeds: dict[str, Any]) -> list[Any]:
        first = not self.inside.is_set()
        self.inside.set()
        if first:
            assert self.go.wait(timeout=30)
        return super().run(outputs, feeds)


def run_threads() -> set[threading.Thread]:
    return {thread for thread in threading.enumerate() if thread.name.startswith("onnx-run_")}


def stopped(before: set[threading.Thread]) -> set[threading.Thread]:
    """The run threads started since ``before`` that are still alive once the idle ones
    have had the chance to end (each is joined: ordered, not timed)."""
    started = run_threads() - before
    for thread in started:
        thread.join(timeout=30)
    return {thread for thread in started if thread.is_alive()}


def test_a_call_after_close_runs_in_the_callers_lane_and_starts_no_thread() -> None:
    before = run_threads()
    session = RecordingSession()
    lanes = Lanes(3)
    runs = ModelRuns(session, tokenizer())
    runs.embed(TEXTS, 1, lanes)
    lanes.close()
    assert not stopped(before)
    session.calls.clear()
    vectors = runs.embed(TEXTS, 1, lanes)
    np.testing.assert_allclose(vectors, expected(TEXTS), atol=1e-5)
    assert {thread for thread, _ in session.calls} == {threading.current_thread().name}
    assert not stopped(before)


def test_closing_during_a_run_lets_it_finish_and_leaves_no_thread() -> None:
    before = run_threads()
    session = GatedSession()
    lanes = Lanes(2, calls_at_once=2)
    runs = ModelRuns(session, tokenizer())
    results: list[Any] = []
    first = threading.Thread(target=lambda: results.append(runs.embed(TEXTS, 1, lanes)))
    first.start()
    assert session.inside.wait(timeout=30)
    # A run is under way (one lane waits inside the model): the embedder closes now.
    lanes.close()
    # Another request arriving after the close takes its caller's lane alone.
    later = runs.embed(TEXTS[:3], 1, lanes)
    session.go.set()
    first.join(timeout=30)
    assert not first.is_alive()
    np.testing.assert_allclose(results[0], expected(TEXTS), atol=1e-5)
    np.testing.assert_allclose(later, expected(TEXTS[:3]), atol=1e-5)
    assert not stopped(before)
