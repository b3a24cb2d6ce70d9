"""Ingest commands: what decodes, what is refused before any transaction, and the
signature that says which tenant may publish (docs/security.md#publish-by-event)."""

from __future__ import annotations

import base64
import uuid

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from services.publisher.ingest.commands import (
    CommandInvalid,
    CommandTooLarge,
    CommandUndecodable,
    DeleteDocument,
    PublishDocument,
    command_registry,
    decode_command,
)
from services.publisher.ingest.signing import (
    IngestKey,
    IngestKeyInvalid,
    SignatureInvalid,
    check_public_key,
    public_bytes,
    sign,
    verify,
)
from services.runtime.messaging.avro import default_registry
from tests.support.ingest import delete_command, publish_command


def test_every_command_schema_is_a_kb_commands_record_with_the_common_fields() -> None:
    registry = command_registry()
    assert registry.event_types == {
        "PublishDocument",
        "SetDocumentReaders",
        "DeleteDocument",
        "EraseDocument",
    }
    for name in registry.event_types:
        schema = registry.writer(name)
        assert schema.full_name == f"kb.commands.{name}"
        fields = {f["name"] for f in schema.parsed["fields"]}
        assert {"commandId", "tenantId", "documentKey", "issuedAt"} <= fields


def test_a_publish_decodes_with_its_inline_content() -> None:
    command_id = uuid.uuid4()
    command = decode_command(
        publish_command("acme", "page-1", b"words", command_id=command_id, read=["u:ann"]),
        max_inline_bytes=100,
    )
    assert isinstance(command, PublishDocument)
    assert (command.command_id, command.tenant_id, command.document_key) == (
        command_id,
        "acme",
        "page-1",
    )
    assert command.content == b"words"
    assert command.read_principals == ("u:ann",)


def test_a_delete_decodes() -> None:
    command = decode_command(delete_command("acme", "k", expected_revision=3), max_inline_bytes=1)
    assert isinstance(command, DeleteDocument)
    assert command.expected_revision == 3


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"not avro",
        b"\xc3\x01" + b"\x00" * 8 + b"body",  # an unknown fingerprint
        publish_command("acme", "k")[:12],  # truncated
    ],
)
def test_what_does_not_decode_is_undecodable(payload: bytes) -> None:
    with pytest.raises(CommandUndecodable):
        decode_command(payload, max_inline_bytes=100)


def test_an_event_is_not_a_command() -> None:
    event = default_registry().encode(
        "IndexTaskCreated",
        {
            "eventId": uuid.uuid4(),
            "tenantId": "acme",
            "tier": "standard",
            "documentId": uuid.uuid4(),
            "versionNumber": 1,
            "taskId": uuid.uuid4(),
            "taskType": "INDEX_VERSION",
            "occurredAt": 0,
        },
    )
    with pytest.raises(CommandUndecodable):
        decode_command(event, max_inline_bytes=100)


def test_inline_content_above_the_limit_is_too_large() -> None:
    with pytest.raises(CommandTooLarge) as raised:
        decode_command(publish_command("acme", "k", b"x" * 11), max_inline_bytes=10)
    assert raised.value.code == "INGEST_COMMAND_TOO_LARGE"
    decode_command(publish_command("acme", "k", b"x" * 10), max_inline_bytes=10)


@pytest.mark.parametrize(
    "payload",
    [
        publish_command("acme", "k", None),  # neither content nor upload
        publish_command("acme", "k", b"x", upload=(uuid.uuid4(), 1)),  # both
        publish_command("Not A Tenant", "k"),
        publish_command("acme", "   "),
        publish_command("acme", "k" * 513),
    ],
)
def test_impossible_commands_are_invalid(payload: bytes) -> None:
    with pytest.raises(CommandInvalid):
        decode_command(payload, max_inline_bytes=100)


def _key(private: Ed25519PrivateKey, key_id: str = "k1") -> IngestKey:
    return IngestKey(key_id, public_bytes(private))


def test_a_signature_verifies_with_its_key_only() -> None:
    acme, beta = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    value = publish_command("beta", "k")
    signature = sign(acme, value)
    verify(_key(acme), value, signature)
    # Signed by acme, naming beta: beta's key does not verify it.
    with pytest.raises(SignatureInvalid):
        verify(_key(beta), value, signature)
    # The signature covers every byte: another tenant, another command.
    with pytest.raises(SignatureInvalid):
        verify(_key(acme), value[:-1] + bytes([value[-1] ^ 1]), signature)


@pytest.mark.parametrize("signature", [None, b"", b"%%%", base64.b64encode(b"x" * 63)])
def test_unsigned_or_malformed_signatures_are_refused(signature: bytes | None) -> None:
    private = Ed25519PrivateKey.generate()
    with pytest.raises(SignatureInvalid) as raised:
        verify(_key(private), b"value", signature)
    assert raised.value.code == "INGEST_SIGNATURE_INVALID"


def test_no_key_refuses_even_a_good_signature() -> None:
    private = Ed25519PrivateKey.generate()
    with pytest.raises(SignatureInvalid):
        verify(None, b"value", sign(private, b"value"))


def test_a_public_key_is_32_raw_bytes() -> None:
    assert check_public_key(public_bytes(Ed25519PrivateKey.generate()))
    with pytest.raises(IngestKeyInvalid):
        check_public_key(b"x" * 31)
