"""The chaos run's poison commands: each kind is refused by the consumer's own decode and
signature check with the code the run expects; the check passes a poison dead-lettered
once (or again, from the same place, after a crash) with its partition moving on, and
reports every other outcome."""

from __future__ import annotations

import dataclasses

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kbtools.chaos.checks.dead_letters import EXPECTED_CODE, DeadLetter, check_poisons
from kbtools.chaos.checks.result import INGEST_POISON, CheckResult
from kbtools.chaos.rig.topology import MAX_INLINE_BYTES
from kbtools.chaos.traffic.poison import POISON_HEADER, Poison, PoisonKind, Sent, poison_record
from services.publisher.ingest.commands import decode_command
from services.publisher.ingest.signing import (
    KEY_ID_HEADER,
    SIGNATURE_HEADER,
    IngestKey,
    public_bytes,
    verify,
)
from services.runtime.errors import KbError

KEYS = {"acme": Ed25519PrivateKey.generate(), "beta": Ed25519PrivateKey.generate()}
TOPIC = "kb.ingest.standard"
NEXT = frozenset({"c-next"})


def _refusal(kind: PoisonKind) -> str:
    """The code the consumer's decode-then-verify gives the poison (process.py's order),
    with the registered keys looked up by the tenant the command names."""
    _, value, headers = poison_record(kind, "acme", "record-1", KEYS, "chaos")
    signature = dict(headers)[SIGNATURE_HEADER]
    assert dict(headers)[KEY_ID_HEADER] == b"chaos"
    try:
        command = decode_command(value, max_inline_bytes=MAX_INLINE_BYTES)
        known = KEYS.get(command.tenant_id)
        key = None if known is None else IngestKey("chaos", public_bytes(known))
        verify(key, value, signature)
    except KbError as error:
        return error.code
    return "applied"


@pytest.mark.parametrize("kind", list(PoisonKind))
def test_each_poison_is_refused_with_the_code_the_run_expects(kind: PoisonKind) -> None:
    assert _refusal(kind) == EXPECTED_CODE[kind]


def _poison(**changes: object) -> Poison:
    poison = Poison("p1", PoisonKind.TOO_LARGE, "acme", "c-poison", Sent(TOPIC, 2, 10))
    poison.followed_by = ("c-next", Sent(TOPIC, 2, 11))
    return dataclasses.replace(poison, **changes)  # type: ignore[arg-type]


def _letter(
    code: str = "INGEST_COMMAND_TOO_LARGE", source: str = f"{TOPIC}/2/10", poison: str = "p1"
) -> DeadLetter:
    headers = {"kb-problem-code": code, "kb-source": source}
    if poison:
        headers[POISON_HEADER] = poison
    return DeadLetter("kb.ingest-dead.standard", headers)


def _checked(
    poison: Poison, letters: list[DeadLetter], applied: frozenset[str] = frozenset({"c-next"})
) -> CheckResult:
    result = CheckResult()
    check_poisons([poison], letters, lambda _tenant, command: command in applied, result)
    return result


def test_a_poison_dead_lettered_once_with_its_partition_moving_on_passes() -> None:
    result = _checked(_poison(), [_letter()])
    assert result.total == 0, result.evidence
    assert result.figures["poison commands sent"] == 1
    assert result.figures["poison dead letters written again after a crash"] == 0


def test_a_copy_from_the_same_place_after_a_crash_is_counted_not_judged() -> None:
    result = _checked(_poison(), [_letter(), _letter()])
    assert result.total == 0, result.evidence
    assert result.figures["poison dead letters written again after a crash"] == 1


@pytest.mark.parametrize(
    ("poison", "letters", "applied", "said"),
    [
        (_poison(), [], NEXT, "never dead-lettered"),
        (_poison(), [_letter(code="INGEST_SIGNATURE_INVALID")], NEXT, "not INGEST"),
        (_poison(), [_letter(), _letter(source=f"{TOPIC}/2/12")], NEXT, "name"),
        (_poison(), [_letter()], frozenset(), "never applied"),
        (_poison(), [_letter()], NEXT | {"c-poison"}, "its command was applied"),
        (_poison(followed_by=None), [_letter()], NEXT, "no command was sent"),
        (_poison(followed_by=("c-next", Sent(TOPIC, 3, 11))), [_letter()], NEXT, "went to"),
        (_poison(), [_letter(), _letter(poison="")], NEXT, "of the load"),
    ],
    ids=[
        "missing",
        "wrong code",
        "another source",
        "next not applied",
        "poison applied",
        "nothing after it",
        "next elsewhere",
        "a load command dead-lettered",
    ],
)
def test_every_other_outcome_is_reported(
    poison: Poison, letters: list[DeadLetter], applied: frozenset[str], said: str
) -> None:
    result = _checked(poison, letters, applied)
    assert result.violations[INGEST_POISON] == 1, result.evidence
    assert said in result.evidence[INGEST_POISON][0]
