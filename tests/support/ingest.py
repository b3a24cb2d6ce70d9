"""Producing signed ingest commands, for tests (docs/architecture.md#publish-by-event)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import asyncpg
from aiokafka import AIOKafkaProducer
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from services.publisher.ingest.commands import (
    DELETE_DOCUMENT,
    ERASE_DOCUMENT,
    PUBLISH_DOCUMENT,
    SET_DOCUMENT_READERS,
    encode_command,
)
from services.publisher.ingest.signing import KEY_ID_HEADER, SIGNATURE_HEADER, public_bytes, sign
from services.publisher.ingest.store_pg import PgIngestKeys


@dataclass
class Signer:
    """A tenant's producer: its key registered under ``key_id``."""

    tenant_id: str
    key_id: str = "k1"
    private_key: Ed25519PrivateKey = field(default_factory=Ed25519PrivateKey.generate)

    async def register(self, conn: asyncpg.Connection[Any]) -> Signer:
        await PgIngestKeys(conn).add(self.tenant_id, self.key_id, public_bytes(self.private_key))
        return self

    def headers(self, value: bytes) -> list[tuple[str, bytes]]:
        return [
            (KEY_ID_HEADER, self.key_id.encode()),
            (SIGNATURE_HEADER, sign(self.private_key, value)),
        ]


def publish_command(
    tenant_id: str,
    key: str,
    content: bytes | None = b"hello",
    *,
    command_id: uuid.UUID | None = None,
    title: str = "A page",
    read: list[str] | None = None,
    upload: tuple[uuid.UUID, int] | None = None,
    expected_revision: int | None = None,
) -> bytes:
    return encode_command(
        PUBLISH_DOCUMENT,
        {
            **_common(tenant_id, key, command_id),
            "title": title,
            "content": content,
            "mediaType": "text/plain" if content is not None else None,
            "filename": None,
            "upload": None
            if upload is None
            else {"documentId": upload[0], "versionNumber": upload[1]},
            "readPrincipals": read or ["group:all"],
            "expectedRevision": expected_revision,
        },
    )


def readers_command(
    tenant_id: str, key: str, read: list[str], *, command_id: uuid.UUID | None = None
) -> bytes:
    return encode_command(
        SET_DOCUMENT_READERS,
        {**_common(tenant_id, key, command_id), "readPrincipals": read, "expectedRevision": None},
    )


def delete_command(
    tenant_id: str,
    key: str,
    *,
    command_id: uuid.UUID | None = None,
    expected_revision: int | None = None,
) -> bytes:
    return encode_command(
        DELETE_DOCUMENT,
        {**_common(tenant_id, key, command_id), "expectedRevision": expected_revision},
    )


def erase_command(tenant_id: str, key: str, *, command_id: uuid.UUID | None = None) -> bytes:
    return encode_command(ERASE_DOCUMENT, _common(tenant_id, key, command_id))


def _common(tenant_id: str, key: str, command_id: uuid.UUID | None) -> dict[str, Any]:
    return {
        "commandId": command_id or uuid.uuid4(),
        "tenantId": tenant_id,
        "documentKey": key,
        "issuedAt": datetime.now(UTC),
    }


async def send(
    producer: AIOKafkaProducer,
    topic: str,
    signer: Signer | None,
    tenant_id: str,
    key: str,
    value: bytes,
) -> None:
    """One record keyed by tenant and document, as producers must key them."""
    headers = signer.headers(value) if signer is not None else []
    await producer.send_and_wait(topic, value, key=f"{tenant_id}/{key}".encode(), headers=headers)
