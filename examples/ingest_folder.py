"""Publish a folder by event, and wait until search serves every file
(docs/architecture.md#publish-by-event).

    KB_INGEST_KEY=<base64 Ed25519 private key> \
        python examples/ingest_folder.py acme examples/policies

The tenant registered the public half first: `kb tenants ingest-keys add acme k1
--public-key <base64>` (`python examples/ingest_folder.py --new-key` makes a pair). Each
file becomes a `PublishDocument` keyed by its path (the producer's own document key); the
answers are the `DocumentSearchVersionSwitched` (or, for a file that can never be indexed,
`DocumentIndexingFailed`) events on `kb.document-events` that carry our command ids.
"""

from __future__ import annotations

import asyncio
import base64
import os
import sys
import uuid
from datetime import UTC, datetime
from pathlib import Path

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

from services.publisher.ingest.commands import PUBLISH_DOCUMENT, encode_command
from services.publisher.ingest.signing import KEY_ID_HEADER, SIGNATURE_HEADER, public_bytes, sign
from services.runtime.messaging.avro import default_registry

BOOTSTRAP = os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092")
PREFIX = os.environ.get("KB_KAFKA_TOPIC_PREFIX", "")


def files(folder: Path) -> dict[str, bytes]:
    """Each file's content by its path under ``folder``: the producer's document key."""
    found = sorted(p for p in folder.rglob("*") if p.is_file())
    return {str(p.relative_to(folder)): p.read_bytes() for p in found}


async def from_the_end(events: AIOKafkaConsumer, topic: str) -> None:
    """Read only what comes after now, fixed before the first send: a consumer left to find
    "the end" by itself may find it after the first answers and wait for them forever."""
    await events.topics()  # the cluster's metadata, so the topic's partitions are known
    partitions = [TopicPartition(topic, p) for p in events.partitions_for_topic(topic) or ()]
    if not partitions:  # a new topic (no answer anywhere yet): all of it, from the start
        events.subscribe([topic])
        return
    events.assign(partitions)
    for partition, end in (await events.end_offsets(partitions)).items():
        events.seek(partition, end)


async def main(tenant: str, folder: Path, tier: str = "standard", key_id: str = "k1") -> None:
    key = Ed25519PrivateKey.from_private_bytes(base64.b64decode(os.environ["KB_INGEST_KEY"]))
    events = AIOKafkaConsumer(bootstrap_servers=BOOTSTRAP, auto_offset_reset="earliest")
    producer = AIOKafkaProducer(bootstrap_servers=BOOTSTRAP, acks="all")
    await events.start()
    await producer.start()
    await from_the_end(events, f"{PREFIX}kb.document-events")
    waiting: dict[uuid.UUID, str] = {}
    for name, content in files(folder).items():
        command_id = uuid.uuid4()
        value = encode_command(
            PUBLISH_DOCUMENT,
            {
                "commandId": command_id,
                "tenantId": tenant,
                "documentKey": name,
                "title": Path(name).stem,
                "content": content,
                "filename": Path(name).name,
                "readPrincipals": ["group:all"],
                "issuedAt": datetime.now(UTC),
            },
        )
        headers = [(KEY_ID_HEADER, key_id.encode()), (SIGNATURE_HEADER, sign(key, value))]
        # Keyed by tenant and document: one document's commands apply in the order sent.
        record_key = f"{tenant}/{name}".encode()
        await producer.send_and_wait(
            f"{PREFIX}kb.ingest.{tier}", value, key=record_key, headers=headers
        )
        waiting[command_id] = name
    await producer.stop()
    async for message in events:  # the answers
        event = default_registry().decode(message.value or b"")
        if event.event_type == "DocumentSearchVersionSwitched":
            name = waiting.pop(event.record.get("commandId"), None)
            if name is not None:
                print(f"searchable: {name}")
        elif event.event_type == "DocumentIndexingFailed":
            name = waiting.pop(event.record.get("commandId"), None)
            if name is not None:
                print(f"failed: {name} ({event.record['errorCode']})")
        if not waiting:
            break
    await events.stop()


def new_key() -> None:
    """A new key pair, each half as the raw bytes in base64."""
    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
    print(f"KB_INGEST_KEY={base64.b64encode(private).decode()}")
    print(f"PUBLIC_KEY={base64.b64encode(public_bytes(key)).decode()}")


if __name__ == "__main__":
    if sys.argv[1:] == ["--new-key"]:
        new_key()
    else:
        asyncio.run(main(sys.argv[1], Path(sys.argv[2])))
