"""Avro single-object encoding, the schema registry and schema evolution."""

from __future__ import annotations

import copy
import io
import json
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import fastavro
import pytest

from services.runtime.messaging.avro import (
    MAGIC,
    AvroEncodeFailed,
    MalformedAvroPayload,
    SchemaRegistry,
    SchemaRegistryInvalid,
    UnknownEventType,
    UnknownSchemaFingerprint,
    default_registry,
    parse_schema,
    schemas_dir,
)

EVENT_TYPES = [
    "IndexTaskCreated",
    "DocumentVersionPublished",
    "DocumentSearchVersionSwitched",
    "DocumentDeleted",
    "DocumentIndexingFailed",
]
# Schemas that evolved (the command id, issue 44): the version before is kept as .v1 so its
# payloads still decode.
EVOLVED = ["DocumentVersionPublished", "DocumentSearchVersionSwitched", "DocumentDeleted"]
NOW = datetime(2026, 3, 1, 12, 0, 0, 123456, tzinfo=UTC)


def _sample(event_type: str) -> dict[str, Any]:
    common = {
        "eventId": uuid.uuid4(),
        "tenantId": "acme",
        "tier": "standard",
        "documentId": uuid.uuid4(),
        "versionNumber": 2,
        "occurredAt": NOW,
    }
    specific: dict[str, dict[str, Any]] = {
        "IndexTaskCreated": {"taskId": uuid.uuid4(), "taskType": "INDEX_VERSION"},
        "DocumentVersionPublished": {
            "revision": 5,
            "previousPublishedVersion": 1,
            "title": "Refund policy",
            "mediaType": "text/plain",
            "sha256": "ab" * 32,
            "sizeBytes": 123,
            "readPrincipals": ["group:support"],
            "indexTaskId": uuid.uuid4(),
        },
        "DocumentSearchVersionSwitched": {
            "previousVersionNumber": None,
            "embeddingModel": "local-hash-256",
            "chunkCount": 7,
            "taskId": uuid.uuid4(),
        },
        "DocumentDeleted": {
            "revision": 4,
            "previousSearchVersion": 1,
            "cancelledTasks": 2,
        },
        # Born with its command id (no .v1): a field of its own, not an evolution.
        "DocumentIndexingFailed": {
            "taskId": uuid.uuid4(),
            "errorCode": "DOCUMENT_PARSE_FAILED",
            "commandId": uuid.uuid4(),
        },
    }
    evolved = {"commandId": uuid.uuid4()} if event_type in EVOLVED else {}
    return {**common, **specific[event_type], **evolved}


def _raw(event_type: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((schemas_dir() / f"{event_type}.avsc").read_text())
    return loaded


def _crc_64_avro(data: bytes) -> int:
    """CRC-64-AVRO exactly as the Avro specification writes it (an independent oracle)."""
    empty = 0xC15D213AA4D7A795
    table = []
    for i in range(256):
        fp = i
        for _ in range(8):
            fp = (fp >> 1) ^ (empty & -(fp & 1))
        table.append(fp)
    fp = empty
    for byte in data:
        fp = (fp >> 8) ^ table[(fp ^ byte) & 0xFF]
    return fp


def test_the_oracle_matches_the_specifications_test_vector() -> None:
    # From the Avro test suite: the fingerprint of "null" as a signed long.
    assert _crc_64_avro(b'"null"') == 7195948357588979594


@pytest.mark.parametrize("event_type", EVENT_TYPES)
def test_the_header_carries_the_little_endian_fingerprint_of_the_canonical_form(
    event_type: str,
) -> None:
    schema = default_registry().writer(event_type)
    # Parsing canonical form: full name, no doc, no logical types, no defaults.
    assert '"doc"' not in schema.canonical_form
    assert "logicalType" not in schema.canonical_form
    assert f'"name":"kb.events.{event_type}"' in schema.canonical_form
    expected = _crc_64_avro(schema.canonical_form.encode()).to_bytes(8, "little")
    assert schema.fingerprint == expected
    payload = default_registry().encode(event_type, _sample(event_type))
    assert payload[2:10] == expected


def test_every_event_type_has_a_schema_carrying_the_common_fields() -> None:
    registry = default_registry()
    assert registry.event_types == frozenset(EVENT_TYPES)
    for event_type in EVENT_TYPES:
        raw = _raw(event_type)
        assert raw["namespace"] == "kb.events"
        names = {f["name"] for f in raw["fields"]}
        assert {"eventId", "tenantId", "tier", "documentId", "versionNumber", "occurredAt"} <= names


@pytest.mark.parametrize("event_type", EVENT_TYPES)
def test_round_trip_in_single_object_encoding(event_type: str) -> None:
    registry = default_registry()
    record = _sample(event_type)
    payload = registry.encode(event_type, record)
    assert payload[:2] == MAGIC == b"\xc3\x01"
    assert payload[2:10] == registry.writer(event_type).fingerprint
    decoded = registry.decode(payload)
    assert decoded.event_type == event_type
    assert decoded.record == record


def _evolved(event_type: str) -> dict[str, Any]:
    """The next version of a schema: one more field, with a default (a compatible change)."""
    raw = copy.deepcopy(_raw(event_type))
    raw["fields"].append({"name": "traceId", "type": ["null", "string"], "default": None})
    raw["fields"].append({"name": "priority", "type": "int", "default": 0})
    return raw


@pytest.mark.parametrize("event_type", EVENT_TYPES)
def test_old_readers_decode_new_writers_and_the_reverse(event_type: str) -> None:
    old = parse_schema(_raw(event_type))
    new = parse_schema(_evolved(event_type))
    assert old.fingerprint != new.fingerprint
    # A consumer still on the old code knows both fingerprints only if schemas/ keeps both:
    # here the new one is current and the old one kept as <Name>.v1.avsc.
    registry = SchemaRegistry(current=[new], older=[old])
    record = _sample(event_type)

    new_payload = registry.encode(event_type, {**record, "traceId": "t-1", "priority": 3})
    as_old = registry.decode(new_payload, reader=old)
    assert as_old.record == record  # the new fields are skipped
    assert as_old.writer.fingerprint == new.fingerprint

    old_registry = SchemaRegistry(current=[old])
    old_payload = old_registry.encode(event_type, record)
    as_new = registry.decode(old_payload)  # reader: the current (new) schema
    assert as_new.record == {**record, "traceId": None, "priority": 0}  # defaults filled
    assert as_new.writer.fingerprint == old.fingerprint


def test_an_unknown_fingerprint_fails_with_a_typed_error() -> None:
    registry = default_registry()
    payload = registry.encode("IndexTaskCreated", _sample("IndexTaskCreated"))
    forged = payload[:2] + b"\x01\x02\x03\x04\x05\x06\x07\x08" + payload[10:]
    with pytest.raises(UnknownSchemaFingerprint) as caught:
        registry.decode(forged)
    assert caught.value.code == "AVRO_UNKNOWN_FINGERPRINT"
    assert caught.value.fingerprint == b"\x01\x02\x03\x04\x05\x06\x07\x08"
    assert "0102030405060708" in str(caught.value)

    # A newer writer this (old) registry has never heard of.
    newer = parse_schema(_evolved("IndexTaskCreated"))
    newer_payload = SchemaRegistry(current=[newer]).encode(
        "IndexTaskCreated", _sample("IndexTaskCreated")
    )
    with pytest.raises(UnknownSchemaFingerprint):
        registry.decode(newer_payload)


@pytest.mark.parametrize(
    "payload", [b"", b"\xc3", b"\xc3\x01\x00", b"{}" + b"\x00" * 10, b"\xc3\x02" + b"\x00" * 10]
)
def test_payloads_that_are_not_single_object_encoded_are_malformed(payload: bytes) -> None:
    with pytest.raises(MalformedAvroPayload):
        default_registry().decode(payload)


def test_a_truncated_body_is_malformed() -> None:
    registry = default_registry()
    payload = registry.encode("IndexTaskCreated", _sample("IndexTaskCreated"))
    with pytest.raises(MalformedAvroPayload):
        registry.decode(payload[:20])


def test_encoding_a_record_the_schema_refuses_is_a_programming_error() -> None:
    registry = default_registry()
    record = _sample("IndexTaskCreated")
    del record["taskId"]
    with pytest.raises(AvroEncodeFailed):
        registry.encode("IndexTaskCreated", record)
    with pytest.raises(UnknownEventType):
        registry.encode("NoSuchEvent", record)


def test_a_refused_record_is_told_by_its_field_a_union_branch_matched_or_not() -> None:
    # The yes-or-no validation must refuse what the raising one refused, and still say why.
    registry = default_registry()
    missing = _sample("IndexTaskCreated")
    del missing["taskId"]
    with pytest.raises(AvroEncodeFailed, match="taskId"):
        registry.encode("IndexTaskCreated", missing)
    wrong = {**_sample("DocumentVersionPublished"), "previousPublishedVersion": "one"}
    with pytest.raises(AvroEncodeFailed, match="previousPublishedVersion"):
        registry.encode("DocumentVersionPublished", wrong)


@pytest.mark.parametrize("event_type", EVENT_TYPES)
@pytest.mark.parametrize("nulls", [False, True])
def test_the_body_is_fastavros_own_bytes_whichever_union_branch(
    event_type: str, nulls: bool
) -> None:
    registry = default_registry()
    schema = registry.writer(event_type)
    record = _sample(event_type)
    if nulls:  # every optional field in its null branch
        for field in _raw(event_type)["fields"]:
            if isinstance(field["type"], list) and "null" in field["type"]:
                record[field["name"]] = None
    body = io.BytesIO()
    fastavro.schemaless_writer(body, schema.parsed, dict(record))
    assert registry.encode(event_type, record)[10:] == body.getvalue()


def test_a_directory_keeps_older_versions_by_file_name(tmp_path: Path) -> None:
    (tmp_path / "IndexTaskCreated.v1.avsc").write_text(json.dumps(_raw("IndexTaskCreated")))
    (tmp_path / "IndexTaskCreated.avsc").write_text(json.dumps(_evolved("IndexTaskCreated")))
    registry = SchemaRegistry.from_directory(tmp_path)
    old = parse_schema(_raw("IndexTaskCreated"))
    assert registry.writer("IndexTaskCreated").fingerprint != old.fingerprint
    assert registry.schema_for(old.fingerprint).fingerprint == old.fingerprint
    old_payload = SchemaRegistry(current=[old]).encode(
        "IndexTaskCreated", _sample("IndexTaskCreated")
    )
    assert registry.decode(old_payload).record["priority"] == 0


@pytest.mark.parametrize(
    ("filename", "schema_name"),
    [("Wrong.avsc", "IndexTaskCreated"), ("IndexTaskCreated.json.avsc", "IndexTaskCreated")],
)
def test_badly_named_schema_files_are_refused(
    tmp_path: Path, filename: str, schema_name: str
) -> None:
    (tmp_path / filename).write_text(json.dumps(_raw(schema_name)))
    with pytest.raises(SchemaRegistryInvalid):
        SchemaRegistry.from_directory(tmp_path)


def test_every_file_in_schemas_is_loaded() -> None:
    files = sorted(p.name for p in schemas_dir().glob("*.avsc"))
    assert files == sorted(
        [f"{name}.avsc" for name in EVENT_TYPES] + [f"{name}.v1.avsc" for name in EVOLVED]
    )


@pytest.mark.parametrize("event_type", EVOLVED)
def test_events_written_before_the_command_id_decode_with_it_empty(event_type: str) -> None:
    registry = default_registry()
    old = parse_schema(_raw_file(f"{event_type}.v1.avsc"))
    record = {k: v for k, v in _sample(event_type).items() if k != "commandId"}
    before = SchemaRegistry(current=[old]).encode(event_type, record)
    assert registry.decode(before).record == {**record, "commandId": None}
    command_id = uuid.uuid4()
    now = registry.encode(event_type, {**record, "commandId": command_id})
    assert registry.decode(now).record["commandId"] == command_id
    # A consumer still on the schema before reads the new payload, the field skipped.
    assert registry.decode(now, reader=old).record == record


def _raw_file(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((schemas_dir() / name).read_text())
    return loaded
