"""What a chaos run's checks found: violations per invariant, with a few examples of
evidence each, and the figures of the run's table."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

RERUN_SAME_CHUNKS = "re-run of a succeeded task: same chunks"
HIT_IN_ITS_VERSION = "search: every hit in its version's chunk set"
ONE_GENERATION = "search: one generation per answer"
READ_YOUR_SWITCH = "search: read-your-switch (after token)"
RECOVERS = "every process recovers by itself"
DELETED_UNANSWERED = "deleted: never in a search answer after its delete"
DELETE_FINAL = "deleted: stays deleted"
ERASED_GONE = "erased: nothing of its content left (pg_dump, Kafka)"
INGEST_ONCE = "ingest: every command applied exactly once"
INGEST_POISON = "ingest: every poison dead-lettered, its partition moving on"

INVARIANTS = (
    "tasks settled",
    "no DEAD for a provider fault",
    "pointer at newest indexed version",
    "pointer only moves forward",
    "one chunk set per served version",
    RERUN_SAME_CHUNKS,
    "no write by a stale lease",
    "outbox events all in Kafka, in order",
    "search: one whole version per document",
    HIT_IN_ITS_VERSION,
    ONE_GENERATION,
    READ_YOUR_SWITCH,
    "search: within ACL and tenant",
    "kb index check clean",
    RECOVERS,
    DELETED_UNANSWERED,
    DELETE_FINAL,
    ERASED_GONE,
    INGEST_ONCE,
    INGEST_POISON,
)
KEEP = 5  # examples of evidence kept per invariant


@dataclass
class CheckResult:
    violations: dict[str, int] = field(default_factory=lambda: dict.fromkeys(INVARIANTS, 0))
    evidence: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    figures: dict[str, Any] = field(default_factory=dict)

    def violate(self, invariant: str, detail: str) -> None:
        self.violations[invariant] += 1
        if len(self.evidence[invariant]) < KEEP:
            self.evidence[invariant].append(detail)

    @property
    def total(self) -> int:
        return sum(self.violations.values())
