"""Poison commands in a chaos run: now and then, right before a publish by command, a
record that can never apply is sent on the same partition (the same record key), and the
check that each landed in `kb.ingest-dead.<tier>` with its problem code while the command
after it on that partition was applied (docs/architecture.md#publish-by-event).

Dead letters are at least once (a consumer killed after writing one and before its offset
commit writes it again): a poison's copies must all name the one place it was sent to
(`kb-source`: topic/partition/offset), and are counted, not judged."""

from __future__ import annotations

import enum
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kbtools.chaos.result import INGEST_POISON, CheckResult
from services.publisher.ingest.commands import PUBLISH_DOCUMENT, encode_command
from services.publisher.ingest.consumer_kafka import PROBLEM_CODE_HEADER, SOURCE_HEADER
from services.publisher.ingest.signing import KEY_ID_HEADER, SIGNATURE_HEADER, sign

POISON_EVERY = 10  # of the publishes by command, each tenth follows a poison on its partition
POISON_HEADER = "kb-chaos-poison"  # the poison's id; a dead letter keeps the record's headers
# KB_INGEST_MAX_INLINE_BYTES of the run's consumers (topology.py): the run's documents are
# far below it, the too-large poison just above it (and below the broker's record limit).
MAX_INLINE_BYTES = 256 * 1024
NO_TENANT = "chaos-nobody"  # a tenant id no tenant has: no key of it verifies anything


class PoisonKind(enum.StrEnum):
    UNDECODABLE = "undecodable bytes"
    BAD_SIGNATURE = "signed with another tenant's key"
    TOO_LARGE = "inline content over the limit"
    UNKNOWN_TENANT = "for a tenant that does not exist"


# The problem code each must be dead-lettered with. An unknown tenant has no ingest key, so
# its command is refused as unsigned for it: the consumer tells no producer which tenants exist.
EXPECTED_CODE = {
    PoisonKind.UNDECODABLE: "INGEST_COMMAND_UNDECODABLE",
    PoisonKind.BAD_SIGNATURE: "INGEST_SIGNATURE_INVALID",
    PoisonKind.TOO_LARGE: "INGEST_COMMAND_TOO_LARGE",
    PoisonKind.UNKNOWN_TENANT: "INGEST_SIGNATURE_INVALID",
}
KINDS = tuple(PoisonKind)


@dataclass(frozen=True)
class Sent:
    """Where a record went (the producer's acknowledgement)."""

    topic: str
    partition: int
    offset: int


@dataclass
class Poison:
    poison_id: str
    kind: PoisonKind
    tenant_id: str  # whose partition (the record key's tenant)
    command_id: str  # of the command inside, never to be recorded ("" when undecodable)
    at: Sent
    followed_by: tuple[str, Sent] | None = None  # the next command on its partition, id


@dataclass(frozen=True)
class DeadLetter:
    topic: str
    headers: Mapping[str, str]


def poison_record(
    kind: PoisonKind,
    tenant_id: str,
    document_key: str,
    keys: Mapping[str, Ed25519PrivateKey],
    key_id: str,
) -> tuple[str, bytes, list[tuple[str, bytes]]]:
    """The command id inside, the value and the headers of a poison of ``kind``."""
    command_id = uuid.uuid4()
    named = NO_TENANT if kind is PoisonKind.UNKNOWN_TENANT else tenant_id
    content = b"x" * (MAX_INLINE_BYTES + 1) if kind is PoisonKind.TOO_LARGE else b"poison"
    value = encode_command(
        PUBLISH_DOCUMENT,
        {
            "commandId": command_id,
            "tenantId": named,
            "documentKey": f"{document_key}-poison",
            "issuedAt": datetime.now(UTC),
            "title": "Poison",
            "content": content,
            "mediaType": "text/plain",
            "filename": "poison.txt",
            "upload": None,
            "readPrincipals": ["group:red"],
            "expectedRevision": None,
        },
    )
    signer = keys[tenant_id]
    if kind is PoisonKind.UNDECODABLE:
        value, command_id_text = b"\x00not a single-object encoding " + value[:64], ""
    else:
        command_id_text = str(command_id)
    if kind is PoisonKind.BAD_SIGNATURE:
        signer = next(k for t, k in sorted(keys.items()) if t != tenant_id)
    headers = [(KEY_ID_HEADER, key_id.encode()), (SIGNATURE_HEADER, sign(signer, value))]
    return command_id_text, value, headers


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
