"""The run's one table: what was done to the system, what it did, and the violations per
invariant (Markdown, so that it can be pasted into RELIABILITY.md as printed)."""

from __future__ import annotations

from kbtools.chaos.checks.result import INVARIANTS, CheckResult
from kbtools.chaos.rig.faults import FaultRecord
from kbtools.chaos.rig.schedule import FaultKind
from kbtools.chaos.traffic.load import LoadRecord


def table(
    *,
    command: str,
    seed: int,
    load: LoadRecord,
    faults: FaultRecord,
    checked: CheckResult,
    converge_s: float | None,
    elapsed_s: float,
) -> str:
    figures = checked.figures
    kills = sum(faults.done[k.value] for k in (FaultKind.KILL_INDEXER, FaultKind.KILL_RELAY))
    provider = sum(faults.done[k.value] for k in FaultKind if k.value.startswith("provider-"))
    rows: list[tuple[str, object]] = [
        ("command", f"`{command}`"),
        ("seed", seed),
        ("wall time", f"{elapsed_s:.0f} s"),
        ("documents", figures.get("documents", 0)),
        ("versions published", len(load.published)),
        ("corrupt versions published", sum(p.kind == "corrupt-pdf" for p in load.published)),
        (
            "versions published by ingest command (commands sent / applied)",
            f"{sum(bool(p.document_key) for p in load.published)} "
            f"({figures.get('ingest commands sent', 0)} / "
            f"{figures.get('ingest commands applied', 0)})",
        ),
        ("ingest commands sent, by kind", _codes(figures.get("ingest commands", {}))),
        (
            "poison commands sent (dead letters written again after a crash)",
            f"{figures.get('poison commands sent', 0)} "
            f"({figures.get('poison dead letters written again after a crash', 0)})",
        ),
        ("poison commands, by kind", _codes(figures.get("poison commands", {}))),
        ("uploads or publishes refused by the API", len(load.refused)),
        ("API calls retried by the client", load.api_retries),
        ("tasks", figures.get("tasks", 0)),
        (
            "tasks succeeded / dead",
            f"{figures.get('tasks succeeded', 0)} / {figures.get('tasks dead', 0)}",
        ),
        ("dead codes", _codes(figures.get("dead codes", {}))),
        ("SIGKILLs (indexers, relays)", kills),
        (
            "SIGKILLs aimed right after an indexer's completion committed "
            "(struck; of those, before the worker logged the completion)",
            f"{faults.done[FaultKind.KILL_AFTER_COMMIT.value]} "
            f"({faults.done['struck right after a commit']}; "
            f"{figures.get('kills before the completion was logged', 0)})",
        ),
        ("SIGKILLs of ingest consumers", faults.done[FaultKind.KILL_INGEST.value]),
        ("SIGSTOPs past the lease", faults.done[FaultKind.STOP_INDEXER.value]),
        ("indexer kills and stops that struck mid-task", faults.done["struck mid-task"]),
        ("Kafka outages", faults.done[FaultKind.KAFKA_OUTAGE.value]),
        ("PostgreSQL restarts", faults.done[FaultKind.POSTGRES_RESTART.value]),
        ("provider faults (429, 5xx, timeout, malformed, down)", provider),
        ("relay replays while live", faults.done[FaultKind.RELAY_REPLAY.value]),
        ("generation created / switched", _generation(faults)),
        ("faults that could not be applied", len(faults.failed)),
        ("retries (attempts beyond the first)", figures.get("retries", 0)),
        ("takeovers (a claim after an attempt that never ended)", figures.get("takeovers", 0)),
        ("lost leases noticed by their worker", figures.get("lost leases", 0)),
        ("duplicate hints in Kafka", figures.get("duplicate hints", 0)),
        ("pointer switches audited from Kafka", figures.get("switches", 0)),
        (
            "outbox events / Kafka records",
            f"{figures.get('outbox events', 0)} / {figures.get('kafka records', 0)}",
        ),
        (
            "searches (answered, no answer)",
            f"{figures.get('searches', 0)} ({figures.get('searches answered', 0)}, "
            f"{figures.get('searches without answer', 0)})",
        ),
        (
            "searches read from the replica / the primary",
            f"{figures.get('searches read from the replica', 0)} / "
            f"{figures.get('searches read from the primary', 0)}",
        ),
        (
            "searches passing a status's token (that found its document)",
            f"{figures.get('searches with a token', 0)} "
            f"({figures.get('searches with a token that found their document', 0)})",
        ),
        (
            "hits checked against their version's chunk set (of collected versions)",
            f"{figures.get('hits checked against their version', 0)} "
            f"({figures.get('hits of collected versions', 0)})",
        ),
        ("deletes / erases answered", f"{figures.get('deletes', 0)} / {figures.get('erases', 0)}"),
        ("of which", _codes(figures.get("removals", {}))),
        (
            "searches sent after a delete, judged against it (passing a deleted document's "
            "token; of the primary-only API; without a token, the replica's position read)",
            f"{figures.get('searches after a delete, judged', 0)} "
            f"({figures.get('searches passing a delete token', 0)}; "
            f"{figures.get('searches of the primary-only API after a delete', 0)}; "
            f"{figures.get('searches after a delete with the replica position read', 0)})",
        ),
        (
            "hits of deleted documents not judged: the replica not yet past the delete (and "
            "hits of documents deleted later, from searches sent before the delete's answer)",
            f"{figures.get('hits of deleted documents, replica not yet past the delete', 0)} "
            f"({figures.get('hits of deleted documents, sent before the delete answer', 0)})",
        ),
        (
            "erased markers looked for in a pg_dump (markers of kept versions found: text / bytes)",
            f"{figures.get('erased markers looked for in the pg_dump', 0)} "
            f"({figures.get('kept markers found in the pg_dump (text / bytes)', '0 / 0')})",
        ),
        (
            "Kafka records scanned for erased markers",
            figures.get("Kafka records scanned for erased markers", 0),
        ),
        (
            "succeeded tasks re-run and compared",
            figures.get("succeeded tasks re-run and compared", 0),
        ),
        (
            "last fault ended / load ended",
            f"t+{figures.get('faults ended', 0):.0f} s / t+{figures.get('load ended', 0):.0f} s",
        ),
        (
            "time to converge after the last fault ended",
            "not converged" if converge_s is None else f"{converge_s:.1f} s",
        ),
    ]
    rows += [(f"violations: {name}", checked.violations[name]) for name in INVARIANTS]
    lines = ["| | |", "|---|---|"] + [f"| {name} | {value} |" for name, value in rows]
    return "\n".join(lines)


def evidence(checked: CheckResult, faults: FaultRecord) -> str:
    lines = []
    for name, examples in checked.evidence.items():
        lines.append(f"{name}: {checked.violations[name]} violation(s)")
        lines += [f"  - {example}" for example in examples]
    if faults.failed:
        lines.append("faults not applied:")
        lines += [f"  - {failure}" for failure in faults.failed]
    return "\n".join(lines)


def _codes(codes: dict[str, int]) -> str:
    return ", ".join(f"{code} {n}" for code, n in sorted(codes.items())) or "none"


def _generation(faults: FaultRecord) -> str:
    if faults.generation_id is None:
        return "no"
    return f"{faults.generation_id} / {'yes' if faults.generation_switched else 'no'}"
