"""Avro single-object encoding of the events the outbox carries (``schemas/*.avsc``).

A payload is ``C3 01`` + the 8-byte little-endian CRC-64-AVRO fingerprint of the writer
schema's parsing canonical form + the Avro binary body. The fingerprint is how a reader finds
the writer schema, so the registry knows every version ever written: ``<Name>.avsc`` is what
writers use today, ``<Name>.v<N>.avsc`` are the versions before it. A reader decodes with its
own (older or newer) schema and Avro's resolution rules fill defaults or drop unknown fields.

Pure code (fastavro only): producers encode before they call the outbox writer, the relay
never looks inside, consumers decode.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Final

import fastavro
import fastavro.validation
from fastavro.schema import fingerprint as _fingerprint_hex
from fastavro.schema import to_parsing_canonical_form

from services.runtime.errors import KbError
from services.runtime.shipped import shipped_dir

MAGIC: Final = b"\xc3\x01"
FINGERPRINT_SIZE: Final = 8
HEADER_SIZE: Final = len(MAGIC) + FINGERPRINT_SIZE

# `IndexTaskCreated.avsc` (current) or `IndexTaskCreated.v1.avsc` (an older version).
_FILENAME = re.compile(r"^(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:\.v(?P<version>\d+))?\.avsc$")


class AvroError(KbError, code="AVRO_ERROR"): ...


class UnknownSchemaFingerprint(AvroError, code="AVRO_UNKNOWN_FINGERPRINT"):
    """The payload was written with a schema this registry has never seen."""

    def __init__(self, fingerprint: bytes) -> None:
        super().__init__(
            f"no known schema has fingerprint {fingerprint.hex()} (CRC-64-AVRO, little-endian); "
            "keep every schema version ever written in schemas/"
        )
        self.fingerprint = fingerprint


class MalformedAvroPayload(AvroError, code="AVRO_MALFORMED_PAYLOAD"): ...


class UnknownEventType(AvroError, code="AVRO_UNKNOWN_EVENT_TYPE"): ...


class AvroEncodeFailed(AvroError, code="AVRO_ENCODE_FAILED"):
    """A producer handed over a record its schema does not accept: a programming error."""


class SchemaRegistryInvalid(AvroError, code="AVRO_SCHEMA_REGISTRY_INVALID"): ...


@dataclass(frozen=True)
class AvroSchema:
    """One version of one record schema."""

    event_type: str  # the record's short name, e.g. ``IndexTaskCreated``
    full_name: str  # e.g. ``kb.events.IndexTaskCreated``
    canonical_form: str
    fingerprint: bytes  # 8 bytes, little-endian, as written on the wire
    parsed: Any  # fastavro's parsed schema

    @property
    def fingerprint_hex(self) -> str:
        return self.fingerprint.hex()


def parse_schema(definition: Mapping[str, Any] | str) -> AvroSchema:
    raw: Any = json.loads(definition) if isinstance(definition, str) else dict(definition)
    if not isinstance(raw, dict) or raw.get("type") != "record":
        raise SchemaRegistryInvalid("an event schema must be an Avro record")
    # Each version is parsed on its own: two versions of one record share a name.
    parsed = fastavro.parse_schema(raw, named_schemas={})
    canonical = to_parsing_canonical_form(raw)
    fingerprint = bytes.fromhex(_fingerprint_hex(canonical, "CRC-64-AVRO"))
    namespace = raw.get("namespace")
    name = str(raw["name"])
    full_name = name if "." in name or not namespace else f"{namespace}.{name}"
    return AvroSchema(
        event_type=full_name.rsplit(".", 1)[-1],
        full_name=full_name,
        canonical_form=canonical,
        fingerprint=fingerprint,
        parsed=parsed,
    )


@dataclass(frozen=True)
class DecodedEvent:
    event_type: str
    record: dict[str, Any]
    writer: AvroSchema


def payload_fingerprint(payload: bytes) -> bytes:
    if len(payload) < HEADER_SIZE or payload[: len(MAGIC)] != MAGIC:
        raise MalformedAvroPayload(
            "not an Avro single-object encoded payload (expected C3 01 + 8-byte fingerprint)"
        )
    return payload[len(MAGIC) : HEADER_SIZE]


class SchemaRegistry:
    """Every known schema version, by fingerprint; the current writer schema, by event type."""

    def __init__(self, current: Iterable[AvroSchema], older: Iterable[AvroSchema] = ()) -> None:
        self._writers: dict[str, AvroSchema] = {}
        self._by_fingerprint: dict[bytes, AvroSchema] = {}
        for schema in current:
            if schema.event_type in self._writers:
                raise SchemaRegistryInvalid(f"two current schemas for {schema.event_type}")
            self._writers[schema.event_type] = schema
        for schema in [*self._writers.values(), *older]:
            self._by_fingerprint.setdefault(schema.fingerprint, schema)

    @classmethod
    def from_directory(cls, directory: Path | None = None) -> SchemaRegistry:
        directory = directory or schemas_dir()
        current: list[AvroSchema] = []
        older: list[AvroSchema] = []
        for path in sorted(directory.glob("*.avsc")):
            match = _FILENAME.match(path.name)
            if match is None:
                raise SchemaRegistryInvalid(
                    f"{path.name}: schema files are named <Name>.avsc or <Name>.v<N>.avsc"
                )
            schema = parse_schema(path.read_text(encoding="utf-8"))
            if schema.event_type != match["name"]:
                raise SchemaRegistryInvalid(
                    f"{path.name} defines {schema.event_type}; the file name must match"
                )
            (older if match["version"] else current).append(schema)
        return cls(current, older)

    @property
    def event_types(self) -> frozenset[str]:
        return frozenset(self._writers)

    def writer(self, event_type: str) -> AvroSchema:
        try:
            return self._writers[event_type]
        except KeyError:
            raise UnknownEventType(f"no schema for event type {event_type!r}") from None

    def schema_for(self, fingerprint: bytes) -> AvroSchema:
        try:
            return self._by_fingerprint[fingerprint]
        except KeyError:
            raise UnknownSchemaFingerprint(fingerprint) from None

    def encode(self, event_type: str, record: Mapping[str, Any]) -> bytes:
        return encode(self.writer(event_type), record)

    def decode(self, payload: bytes, reader: AvroSchema | None = None) -> DecodedEvent:
        """Decode with the writer schema found by fingerprint, resolved to ``reader`` (by
        default the current schema of the same event type)."""
        writer = self.schema_for(payload_fingerprint(payload))
        if reader is None:
            reader = self._writers.get(writer.event_type, writer)
        return DecodedEvent(writer.event_type, decode(payload, writer, reader), writer)


def encode(schema: AvroSchema, record: Mapping[str, Any]) -> bytes:
    datum = dict(record)
    # Asked to raise, fastavro builds (and throws away) a JSON error message for every
    # union branch a value does not match, a good match included: most of an event's
    # validation time. Asked for a yes or no, it builds none; the message is built only
    # for a record that fails, by validating it again.
    if not fastavro.validation.validate(datum, schema.parsed, raise_errors=False):
        try:
            fastavro.validation.validate(datum, schema.parsed, raise_errors=True)
        except fastavro.validation.ValidationError as exc:
            raise AvroEncodeFailed(f"{schema.event_type}: {exc}") from exc
        raise AvroEncodeFailed(f"{schema.event_type}: the record does not match its schema")
    body = io.BytesIO()
    body.write(MAGIC)
    body.write(schema.fingerprint)
    fastavro.schemaless_writer(body, schema.parsed, datum)
    return body.getvalue()


def decode(payload: bytes, writer: AvroSchema, reader: AvroSchema | None = None) -> dict[str, Any]:
    if payload_fingerprint(payload) != writer.fingerprint:
        raise MalformedAvroPayload(
            f"payload fingerprint {payload_fingerprint(payload).hex()} is not "
            f"{writer.event_type}'s {writer.fingerprint_hex}"
        )
    body = io.BytesIO(payload[HEADER_SIZE:])
    try:
        record = fastavro.schemaless_reader(
            body, writer.parsed, reader.parsed if reader is not None else None
        )
    except (EOFError, ValueError, TypeError, IndexError, KeyError) as exc:
        raise MalformedAvroPayload(f"{writer.event_type}: cannot decode body: {exc}") from exc
    except fastavro.read.SchemaResolutionError as exc:
        raise MalformedAvroPayload(
            f"{writer.event_type}: writer and reader schemas are incompatible: {exc}"
        ) from exc
    if not isinstance(record, dict):
        raise MalformedAvroPayload(f"{writer.event_type}: body is not a record")
    return record


def schemas_dir() -> Path:
    """``schemas/`` of a source checkout, else the copy packaged into the wheel."""
    return shipped_dir("schemas", SchemaRegistryInvalid)


@cache
def default_registry() -> SchemaRegistry:
    """The registry of ``schemas/``, loaded once per process."""
    return SchemaRegistry.from_directory()
