"""The chaos checker's answer, re-run and kill checks on small hand-made inputs: each one
reports a violation when the evidence shows one, and nothing when it does not."""

from __future__ import annotations

import json
import random
from pathlib import Path

from kbtools.chaos.checks.answers import ChunkSets, check_answers, text_digest
from kbtools.chaos.checks.logs import lease_figures, search_reads
from kbtools.chaos.checks.rerun import ServedVersion, compare
from kbtools.chaos.checks.result import (
    HIT_IN_ITS_VERSION,
    ONE_GENERATION,
    READ_YOUR_SWITCH,
    RERUN_SAME_CHUNKS,
    CheckResult,
)
from kbtools.chaos.rig.faults import completed_since, logged_before_kill
from kbtools.chaos.rig.ports import RESERVED, ephemeral_range, listen_port
from kbtools.chaos.rig.topology import SOURCE_ROOT
from kbtools.chaos.traffic.searcher import Answer, Hit, Promise
from tests.support.stack import REPO_ROOT

DOC = "6f1c0e4e-0000-4000-8000-000000000001"
FIRST, SECOND = "hashing-v1-384", "hashing-v1-256"


def _sets() -> ChunkSets:
    """v1 of DOC: chunks a, b in the first generation (1, the default), c in the second (2);
    v2 of DOC: chunk d in the first."""
    sets = ChunkSets(models={1: FIRST, None: FIRST, 2: SECOND})
    sets.add(DOC, 1, FIRST, "a", text_digest("alpha"))
    sets.add(DOC, 1, FIRST, "b", text_digest("beta"))
    sets.add(DOC, 1, SECOND, "c", text_digest("alpha beta"))
    sets.add(DOC, 2, FIRST, "d", text_digest("delta"))
    return sets


def _answer(*hits: Hit, generation: int | None = 1, promise: Promise | None = None) -> Answer:
    return Answer("acme", "acme", ("group:red",), 200, hits, generation, promise)


def _checked(*answers: Answer) -> CheckResult:
    result = CheckResult()
    check_answers(answers, _sets(), result)
    return result


def test_hits_of_their_version_and_generation_pass() -> None:
    result = _checked(
        _answer(Hit(DOC, 1, "a", "alpha"), Hit(DOC, 1, "b", "beta")),
        _answer(Hit(DOC, 1, "c", "alpha beta"), generation=2),
        _answer(Hit(DOC, 2, "d", "delta"), generation=None),
    )
    assert result.total == 0, result.evidence
    assert result.figures["hits checked against their version"] == 4


def test_a_chunk_outside_its_version_is_half_a_version() -> None:
    # "d" is a chunk of v2, answered as v1's: v1 is not whole in that answer.
    result = _checked(_answer(Hit(DOC, 1, "a", "alpha"), Hit(DOC, 1, "d", "delta")))
    assert result.violations[HIT_IN_ITS_VERSION] == 1
    assert "not one of the 2 chunks" in result.evidence[HIT_IN_ITS_VERSION][0]


def test_a_chunk_with_another_text_is_reported() -> None:
    result = _checked(_answer(Hit(DOC, 1, "a", "alpha, edited")))
    assert result.violations[HIT_IN_ITS_VERSION] == 1
    assert "another text" in result.evidence[HIT_IN_ITS_VERSION][0]


def test_an_answer_mixing_two_generations_is_reported() -> None:
    # Served by generation 1, yet holding the second generation's chunk of the version.
    result = _checked(_answer(Hit(DOC, 1, "a", "alpha"), Hit(DOC, 1, "c", "alpha beta")))
    assert result.violations[ONE_GENERATION] == 1
    assert result.violations[HIT_IN_ITS_VERSION] == 0
    assert SECOND in result.evidence[ONE_GENERATION][0]


def test_a_collected_version_is_counted_not_judged() -> None:
    result = _checked(_answer(Hit(DOC, 7, "z", "gone")))
    assert result.total == 0
    assert result.figures["hits of collected versions"] == 1


def test_a_search_with_a_token_must_not_answer_an_older_version() -> None:
    fine = _answer(Hit(DOC, 2, "d", "delta"), promise=Promise(DOC, 2))
    older = _answer(Hit(DOC, 1, "a", "alpha"), promise=Promise(DOC, 2))
    result = _checked(fine, older)
    assert result.violations[READ_YOUR_SWITCH] == 1
    assert "status said v2" in result.evidence[READ_YOUR_SWITCH][0]
    assert result.figures["searches with a token that found their document"] == 2


def test_a_rerun_must_give_back_the_same_chunks() -> None:
    version = ServedVersion("acme", DOC, 1, FIRST, "task-1")
    other = ServedVersion("acme", DOC, 2, FIRST, "task-2")
    before = {version: {"a": (0, "m1"), "b": (1, "m2")}, other: {"d": (0, "m4")}}
    result = CheckResult()
    once = {version: 1, other: 1}
    compare(before, dict(before), {}, once, result)
    assert result.total == 0

    result = CheckResult()
    changed = {version: {"a": (0, "m1"), "x": (1, "m2")}, other: {"d": (0, "m4")}}
    compare(before, changed, {}, once, result)
    assert result.violations[RERUN_SAME_CHUNKS] == 1
    assert "ids gone ['b'], new ['x']" in result.evidence[RERUN_SAME_CHUNKS][0]

    result = CheckResult()
    compare(before, dict(before), {other: 1}, once, result)
    assert result.violations[RERUN_SAME_CHUNKS] == 1
    assert "v2 (hashing-v1-384): no task of it re-ran" in result.evidence[RERUN_SAME_CHUNKS][0]


def test_the_kill_after_commit_waits_for_its_own_completion() -> None:
    running = {"task_id": "t1", "status": "RUNNING", "mine": True}
    assert completed_since([running]) == (None, ["t1"])
    # Taken over and completed by another worker: not this process's commit.
    taken = {"task_id": "t1", "status": "SUCCEEDED", "mine": False}
    assert completed_since([taken]) == (None, [])
    failed = {"task_id": "t1", "status": "RETRY_WAIT", "mine": True}
    assert completed_since([failed]) == (None, [])
    done = {"task_id": "t1", "status": "SUCCEEDED", "mine": True}
    other = {"task_id": "t2", "status": "RUNNING", "mine": True}
    assert completed_since([done, other]) == ("t1", ["t2"])


def test_a_kill_before_the_completion_was_logged_is_told_apart(tmp_path: Path) -> None:
    (tmp_path / "indexer-a.log").write_text(
        '{"task_id": "t1", "owner": "vm:41:x", "event": "task.completed"}\n'
        '{"task_id": "t2", "owner": "vm:41:x", "event": "task.claimed"}\n'
    )
    struck = [("indexer-a", 41, "t1"), ("indexer-a", 41, "t2"), ("indexer-b", 7, "t3")]
    assert logged_before_kill(tmp_path, struck) == 2


def test_the_run_listens_below_the_ephemeral_range() -> None:
    # A restarted server's port must not be one a client connection can be given meanwhile
    # (the provider once failed to come back: "address already in use").
    low, high = ephemeral_range()
    taken: set[int] = set()
    ports = [listen_port(random.Random(seed), taken=taken) for seed in range(20)]
    assert len(set(ports)) == 20
    assert set(ports) == taken
    assert all(port < low or port > high for port in ports)
    assert not set(ports) & RESERVED


def test_lease_figures_count_lost_leases_and_takeovers(tmp_path: Path) -> None:
    def line(event: str, task: str, attempt: int) -> str:
        return json.dumps({"event": event, "task_id": task, "lease_attempt": attempt})

    log = tmp_path / "indexer-standard-1.log"
    log.write_text(
        "\n".join(
            [
                line("task.claimed", "t1", 1),  # killed: taken over by attempt 2
                line("task.claimed", "t1", 2),
                line("task.completed", "t1", 2),
                line("task.claimed", "t2", 1),
                line("task.failed", "t2", 1),
                line("task.claimed", "t2", 2),  # a retry after a failure: no takeover
                line("lease.lost", "t3", 1),
                "not json",
            ]
        )
    )
    assert lease_figures([log]) == (1, 1)


def test_search_reads_count_each_server(tmp_path: Path) -> None:
    log = tmp_path / "api.log"
    entries = [
        {"event": "search.served", "read_from": "primary"},
        {"event": "search.served", "read_from": "replica-1"},
        {"event": "search.served", "read_from": "replica-1"},
        {"event": "http.request", "read_from": "primary"},
    ]
    log.write_text("\n".join(json.dumps(e) for e in entries))
    assert search_reads(log) == (2, 1)
    assert search_reads(tmp_path / "missing.log") == (0, 0)


def test_the_run_starts_its_processes_on_this_checkout() -> None:
    """The processes' PYTHONPATH is the checkout the topology module sits in, however deep
    it sits in the tools' rooms: a wrong root starts them on another tree, or on none."""
    assert SOURCE_ROOT == REPO_ROOT
