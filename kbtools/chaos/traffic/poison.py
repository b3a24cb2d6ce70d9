"""Poison commands in a chaos run: now and then, right before a publish by command, a
record that can never apply is sent on the same partition (the same record key);
kbtools/chaos/checks/dead_letters.py checks that each landed in `kb.ingest-dead.<tier>`
with its problem code while the command after it on that partition was applied
(docs/architecture.md#publish-by-event)."""

from __future__ import annotations

import enum
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kbtools.chaos.rig.topology import MAX_INLINE_BYTES
from services.publisher.ingest.commands import PUBLISH_DOCUMENT, encode_command
from services.publisher.ingest.signing import KEY_ID_HEADER, SIGNATURE_HEADER, sign

POISON_EVERY = 10  # of the publishes by command, each tenth follows a poison on its partition
POISON_HEADER = "kb-chaos-poison"  # the poison's id; a dead letter keeps the record's headers
NO_TENANT = "chaos-nobody"  # a tenant id no tenant has: no key of it verifies anything


class PoisonKind(enum.StrEnum):
    UNDECODABLE = "undecodable bytes"
    BAD_SIGNATURE = "signed with another tenant's key"
    TOO_LARGE = "inline content over the limit"
    UNKNOWN_TENANT = "for a tenant that does not exist"


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
