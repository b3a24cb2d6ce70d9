"""The fault schedule: drawn from a seed, printed before the run, the same for the same seed.

Every kind of fault is planned at least once; the rest of the run's fault budget is drawn
among the kinds weighted towards the cheap ones (SIGKILLs). Times are seconds from the start
of the load, inside the first ``fault_window_s`` so that the system then has time to settle.
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass


class FaultKind(enum.StrEnum):
    KILL_INDEXER = "kill-indexer"  # SIGKILL, restarted after a pause
    KILL_RELAY = "kill-relay"
    # SIGKILL the moment a completion of that indexer committed, before its next step
    KILL_AFTER_COMMIT = "kill-after-commit"
    STOP_INDEXER = "stop-indexer"  # SIGSTOP past the lease, then SIGCONT: a zombie
    KAFKA_OUTAGE = "kafka-outage"  # the broker stopped for a while, then started
    POSTGRES_RESTART = "postgres-restart"
    PROVIDER_429 = "provider-429"
    PROVIDER_5XX = "provider-5xx"
    PROVIDER_TIMEOUT = "provider-timeout"
    PROVIDER_MALFORMED = "provider-malformed"
    PROVIDER_DOWN = "provider-down"  # process killed past the breaker's threshold
    RELAY_REPLAY = "relay-replay"  # `kb relay replay` over a range while live
    GENERATION_SWITCH = "generation-switch"  # a new model generation, then switched to
    KILL_INGEST = "kill-ingest"  # SIGKILL of a `kb ingest run`, restarted after a pause


INDEXERS = ("indexer-standard-1", "indexer-standard-2", "indexer-premium-1", "indexer-premium-2")
RELAYS = ("relay-1", "relay-2")
INGESTERS = ("ingest-standard-1", "ingest-premium-1")  # `kb ingest run`, one per tier
_ONCE = (FaultKind.POSTGRES_RESTART, FaultKind.GENERATION_SWITCH)
_WEIGHTS = {
    FaultKind.KILL_INDEXER: 8,
    FaultKind.KILL_RELAY: 3,
    FaultKind.KILL_AFTER_COMMIT: 3,
    FaultKind.STOP_INDEXER: 1,
    FaultKind.KAFKA_OUTAGE: 1,
    FaultKind.PROVIDER_429: 2,
    FaultKind.PROVIDER_5XX: 2,
    FaultKind.PROVIDER_TIMEOUT: 1,
    FaultKind.PROVIDER_MALFORMED: 1,
    FaultKind.PROVIDER_DOWN: 1,
    FaultKind.RELAY_REPLAY: 1,
}


@dataclass(frozen=True)
class Fault:
    at_s: float
    kind: FaultKind
    target: str = ""
    duration_s: float = 0.0

    def describe(self) -> str:
        target = f" {self.target}" if self.target else ""
        lasting = f" for {self.duration_s:.1f}s" if self.duration_s else ""
        return f"t+{self.at_s:6.1f}s  {self.kind.value}{target}{lasting}"


def plan(seed: int, *, fault_window_s: float, faults: int) -> list[Fault]:
    """``faults`` faults (at least one of each kind) at seeded moments of the window."""
    rng = random.Random(seed)
    kinds: list[FaultKind] = [k for k in FaultKind if k is not FaultKind.KILL_INGEST]
    while len(kinds) < faults:
        drawn = rng.choices(list(_WEIGHTS), weights=list(_WEIGHTS.values()))[0]
        kinds.append(drawn)
    planned = [_fault(rng, kind, rng.uniform(2.0, fault_window_s)) for kind in kinds]
    # The one-off faults in the middle third: there is load before and after them.
    planned = [
        _fault(rng, f.kind, rng.uniform(fault_window_s / 3, 2 * fault_window_s / 3))
        if f.kind in _ONCE
        else f
        for f in planned
    ]
    return sorted(planned + _ingest_kills(seed, fault_window_s, faults), key=lambda f: f.at_s)


def _ingest_kills(seed: int, fault_window_s: float, faults: int) -> list[Fault]:
    """The ingest consumers' kills (one per ten faults, at least one per consumer), drawn
    from a generator of their own: the rest of a seed's schedule is what it was before
    the run published by command."""
    rng = random.Random(seed * 9973 + 11)
    count = max(len(INGESTERS), faults // 10)
    targets = [INGESTERS[n % len(INGESTERS)] for n in range(count)]
    return [
        Fault(round(rng.uniform(2.0, fault_window_s), 1), FaultKind.KILL_INGEST, target,
              round(rng.uniform(0.5, 3.0), 1))
        for target in targets
    ]  # fmt: skip


def _fault(rng: random.Random, kind: FaultKind, at_s: float) -> Fault:
    at_s = round(at_s, 1)
    if kind in (FaultKind.KILL_INDEXER, FaultKind.KILL_AFTER_COMMIT):
        return Fault(at_s, kind, rng.choice(INDEXERS), round(rng.uniform(0.5, 3.0), 1))
    if kind is FaultKind.KILL_RELAY:
        return Fault(at_s, kind, rng.choice(RELAYS), round(rng.uniform(0.5, 3.0), 1))
    if kind is FaultKind.STOP_INDEXER:
        # Past the lease (the chaos indexers' lease is 4 s) so another worker takes over.
        return Fault(at_s, kind, rng.choice(INDEXERS), round(rng.uniform(7.0, 10.0), 1))
    if kind is FaultKind.KAFKA_OUTAGE:
        return Fault(at_s, kind, "kafka", round(rng.uniform(5.0, 10.0), 1))
    if kind is FaultKind.POSTGRES_RESTART:
        return Fault(at_s, kind, "postgres")
    if kind is FaultKind.PROVIDER_DOWN:
        # Longer than the breaker takes to open (five failures) and its first open period.
        return Fault(at_s, kind, "provider", round(rng.uniform(12.0, 16.0), 1))
    if kind in (FaultKind.RELAY_REPLAY, FaultKind.GENERATION_SWITCH):
        return Fault(at_s, kind)
    return Fault(at_s, kind, "provider", round(rng.uniform(2.0, 5.0), 1))
