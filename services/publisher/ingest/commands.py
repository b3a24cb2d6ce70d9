"""The ingest commands (``schemas/commands/*.avsc``, namespace ``kb.commands``), decoded from
Avro single-object encoding into typed values; what a command may carry is checked here,
before any transaction. Pure code: no driver."""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from functools import cache
from typing import Any, Final

from services.runtime.errors import BadInput, PayloadTooLarge
from services.runtime.messaging.avro import AvroError, SchemaRegistry, schemas_dir
from services.runtime.tenancy.tenant_ids import TENANT_ID_PATTERN

PUBLISH_DOCUMENT: Final = "PublishDocument"
SET_DOCUMENT_READERS: Final = "SetDocumentReaders"
DELETE_DOCUMENT: Final = "DeleteDocument"
ERASE_DOCUMENT: Final = "EraseDocument"
COMMAND_TYPES: Final = frozenset(
    {PUBLISH_DOCUMENT, SET_DOCUMENT_READERS, DELETE_DOCUMENT, ERASE_DOCUMENT}
)
MAX_DOCUMENT_KEY_LENGTH: Final = 512


class CommandUndecodable(BadInput, code="INGEST_COMMAND_UNDECODABLE"):
    """Not a command this consumer can read: not Avro single-object encoded, an unknown
    schema fingerprint, or a body its schema cannot decode."""


class CommandInvalid(BadInput, code="INGEST_COMMAND_INVALID", http_status=422):
    """A command that decodes but says something impossible (no content and no upload, a
    tenant id that is not one, a blank document key)."""


class CommandTooLarge(PayloadTooLarge, code="INGEST_COMMAND_TOO_LARGE"):
    """A record larger than KB_INGEST_MAX_COMMAND_BYTES, or inline content larger than
    KB_INGEST_MAX_INLINE_BYTES: larger content goes by reference to an API upload."""


@dataclass(frozen=True)
class UploadReference:
    document_id: uuid.UUID
    version_number: int


@dataclass(frozen=True)
class Command:
    """What every command carries."""

    command_type: str
    command_id: uuid.UUID
    tenant_id: str
    document_key: str


@dataclass(frozen=True)
class PublishDocument(Command):
    title: str
    content: bytes | None
    media_type: str | None
    filename: str | None
    upload: UploadReference | None
    read_principals: tuple[str, ...]
    expected_revision: int | None


@dataclass(frozen=True)
class SetDocumentReaders(Command):
    read_principals: tuple[str, ...]
    expected_revision: int | None


@dataclass(frozen=True)
class DeleteDocument(Command):
    expected_revision: int | None


@dataclass(frozen=True)
class EraseDocument(Command):
    pass


@cache
def command_registry() -> SchemaRegistry:
    """Every command schema version (``schemas/commands/``), loaded once per process."""
    return SchemaRegistry.from_directory(schemas_dir() / "commands")


def encode_command(command_type: str, record: dict[str, Any]) -> bytes:
    """A command as producers write it (examples/ingest_folder.py, tests)."""
    return command_registry().encode(command_type, record)


def decode_command(
    payload: bytes, *, max_inline_bytes: int, registry: SchemaRegistry | None = None
) -> Command:
    """The command in ``payload``; ``CommandUndecodable``, ``CommandInvalid`` or
    ``CommandTooLarge`` when it cannot be applied as it is."""
    try:
        decoded = (registry or command_registry()).decode(payload)
    except AvroError as error:
        raise CommandUndecodable(f"{error.code}: {error}") from None
    record = decoded.record
    common = _common(decoded.event_type, record)
    match decoded.event_type:
        case "PublishDocument":
            return _publish(common, record, max_inline_bytes)
        case "SetDocumentReaders":
            return SetDocumentReaders(
                **common,
                read_principals=tuple(record["readPrincipals"]),
                expected_revision=record["expectedRevision"],
            )
        case "DeleteDocument":
            return DeleteDocument(**common, expected_revision=record["expectedRevision"])
        case "EraseDocument":
            return EraseDocument(**common)
    raise CommandUndecodable(f"{decoded.event_type} is not a command")


def _common(command_type: str, record: dict[str, Any]) -> dict[str, Any]:
    tenant_id, key = record["tenantId"], record["documentKey"]
    if not re.fullmatch(TENANT_ID_PATTERN, tenant_id):
        raise CommandInvalid(f"tenantId {tenant_id[:80]!r} is not a tenant id")
    if not key.strip() or len(key) > MAX_DOCUMENT_KEY_LENGTH:
        raise CommandInvalid(
            f"documentKey must be 1-{MAX_DOCUMENT_KEY_LENGTH} characters, not blank"
        )
    return {
        "command_type": command_type,
        "command_id": uuid.UUID(str(record["commandId"])),
        "tenant_id": tenant_id,
        "document_key": key,
    }


def _publish(common: dict[str, Any], record: dict[str, Any], max_inline: int) -> PublishDocument:
    content, upload = record["content"], record["upload"]
    if (content is None) == (upload is None):
        raise CommandInvalid("a PublishDocument carries either content or upload, not both")
    if content is not None and len(content) > max_inline:
        raise CommandTooLarge(
            f"inline content has {len(content)} bytes; the limit is {max_inline}: upload it "
            "through the API and name the upload"
        )
    reference = None
    if upload is not None:
        reference = UploadReference(uuid.UUID(str(upload["documentId"])), upload["versionNumber"])
    return PublishDocument(
        **common,
        title=record["title"],
        content=content,
        media_type=record["mediaType"],
        filename=record["filename"],
        upload=reference,
        read_principals=tuple(record["readPrincipals"]),
        expected_revision=record["expectedRevision"],
    )
