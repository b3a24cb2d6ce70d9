"""The check of a chaos run's poison commands (kbtools/chaos/traffic/poison.py sends them):
each landed in `kb.ingest-dead.<tier>` with its problem code while the command after it on
that partition was applied (docs/architecture.md#publish-by-event).

Dead letters are at least once (a consumer killed after writing one and before its offset
commit writes it again): a poison's copies must all name the one place it was sent to
(`kb-source`: topic/partition/offset), and are counted, not judged."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kbtools.chaos.checks.result import INGEST_POISON, CheckResult
from kbtools.chaos.traffic.poison import POISON_HEADER, Poison, PoisonKind
from services.publisher.ingest.consumer_kafka import PROBLEM_CODE_HEADER, SOURCE_HEADER

# The problem code each must be dead-lettered with. An unknown tenant has no ingest key, so
# its command is refused as unsigned for it: the consumer tells no producer which tenants exist.
EXPECTED_CODE = {
    PoisonKind.UNDECODABLE: "INGEST_COMMAND_UNDECODABLE",
    PoisonKind.BAD_SIGNATURE: "INGEST_SIGNATURE_INVALID",
    PoisonKind.TOO_LARGE: "INGEST_COMMAND_TOO_LARGE",
    PoisonKind.UNKNOWN_TENANT: "INGEST_SIGNATURE_INVALID",
}


@dataclass(frozen=True)
class DeadLetter:
    topic: str
    headers: Mapping[str, str]


def check_poisons(
    poisons: Iterable[Poison],
    dead: Iterable[DeadLetter],
    recorded: Callable[[str, str], bool],
    result: CheckResult,
) -> None:
    """Each poison dead-lettered with its code, from where it was sent, its command never
    recorded, and the command after it on its partition applied; no other dead letter
    (every command of the load is valid). ``recorded(tenant, command_id)``: its record."""
    copies: dict[str, list[DeadLetter]] = defaultdict(list)
    for letter in dead:
        poison_id = letter.headers.get(POISON_HEADER)
        if poison_id is None:
            result.violate(
                INGEST_POISON,
                f"a command of the load dead-lettered in {letter.topic}: "
                f"{letter.headers.get(PROBLEM_CODE_HEADER)} at {letter.headers.get(SOURCE_HEADER)}",
            )
        else:
            copies[poison_id].append(letter)
    poisons = list(poisons)
    for poison in poisons:
        _check_one(poison, copies.get(poison.poison_id, []), recorded, result)
    kinds = Counter(p.kind.value for p in poisons)
    result.figures["poison commands"] = dict(sorted(kinds.items()))
    result.figures["poison commands sent"] = len(poisons)
    result.figures["poison dead letters written again after a crash"] = sum(
        max(0, len(copies.get(p.poison_id, [])) - 1) for p in poisons
    )


def _check_one(
    poison: Poison,
    copies: list[DeadLetter],
    recorded: Callable[[str, str], bool],
    result: CheckResult,
) -> None:
    at = poison.at
    source = f"{at.topic}/{at.partition}/{at.offset}"
    where = f"poison {poison.poison_id} ({poison.kind.value}) at {source}"
    if not copies:
        result.violate(INGEST_POISON, f"{where}: never dead-lettered")
    codes = {c.headers.get(PROBLEM_CODE_HEADER) for c in copies}
    if copies and codes != {EXPECTED_CODE[poison.kind]}:
        result.violate(
            INGEST_POISON,
            f"{where}: dead-lettered with {sorted(map(str, codes))}, "
            f"not {EXPECTED_CODE[poison.kind]}",
        )
    sources = {c.headers.get(SOURCE_HEADER) for c in copies}
    if copies and sources != {source}:
        result.violate(INGEST_POISON, f"{where}: dead letters name {sorted(map(str, sources))}")
    if poison.command_id and recorded(poison.tenant_id, poison.command_id):
        result.violate(INGEST_POISON, f"{where}: its command was applied")
    if poison.followed_by is None:
        result.violate(INGEST_POISON, f"{where}: no command was sent after it")
        return
    command_id, then = poison.followed_by
    if (then.topic, then.partition) != (at.topic, at.partition) or then.offset <= at.offset:
        result.violate(
            INGEST_POISON,
            f"{where}: the next command {command_id} went to "
            f"{then.topic}/{then.partition}/{then.offset}",
        )
    elif not recorded(poison.tenant_id, command_id):
        result.violate(INGEST_POISON, f"{where}: the next command {command_id} never applied")


def dead_letter(topic: str, headers: Iterable[tuple[str, Any]]) -> DeadLetter:
    return DeadLetter(
        topic, {k: v.decode("utf-8", "replace") for k, v in headers if isinstance(v, bytes)}
    )
