"""`kb ingest run` on the real broker and database (docs/architecture.md#publish-by-event):
poison commands go to the dead-letter topic while the next one of their partition applies,
a command signed for one tenant naming another is refused, a document's commands apply in
order, a consumer SIGKILLed between its transactions and its offset commit loses and
duplicates nothing, and `kb ingest replay-dead` applies a dead letter once it can. A poison
command in the middle of a run is undone and dead-lettered alone, once, even across a kill
and redelivery; a tenant flooding a partition does not hold another's commands behind it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from aiokafka import AIOKafkaProducer

from services.publisher.domain import Publisher, Upload
from services.publisher.ingest.cli import TEST_ONLY_HANG_BEFORE_COMMIT
from services.publisher.store_pg import PgPublisherStore
from services.runtime.messaging.avro import default_registry
from services.runtime.messaging.events import ingest_dead_topic, ingest_topic
from services.runtime.settings import RuntimeSettings
from tests.support.api import add_tenant
from tests.support.cli import kb_async
from tests.support.ingest import (
    Signer,
    delete_command,
    erase_command,
    publish_command,
    readers_command,
    send,
)
from tests.support.kafka import TopicReader, create_topics
from tests.support.stack import REPO_ROOT

pytestmark = pytest.mark.integration

TIER = "standard"


@pytest.fixture
def env(service_env: dict[str, str]) -> dict[str, str]:
    return {**service_env, "KB_INGEST_POLL_TIMEOUT_SECONDS": "0.2", "KB_LOG_LEVEL": "warning"}


@pytest.fixture
async def producer(settings: RuntimeSettings) -> AsyncIterator[AIOKafkaProducer]:
    prefix = settings.kafka_topic_prefix
    await create_topics(
        settings.kafka_bootstrap_servers,
        [ingest_topic(TIER, prefix), ingest_dead_topic(TIER, prefix)],
    )
    kafka = AIOKafkaProducer(bootstrap_servers=settings.kafka_bootstrap_servers, acks="all")
    await kafka.start()
    try:
        yield kafka
    finally:
        await kafka.stop()


@contextlib.asynccontextmanager
async def ingesting(env: dict[str, str]) -> AsyncIterator[asyncio.subprocess.Process]:
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "services.cli",
        "ingest",
        "run",
        "--tier",
        TIER,
        env=env,
        cwd=REPO_ROOT,
    )
    try:
        yield process
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
            async with asyncio.timeout(30):
                await process.wait()


async def until(
    conn: asyncpg.Connection[Any], sql: str, expected: Any, seconds: float = 60
) -> None:
    """Poll ``sql`` until it answers ``expected`` (the outcome of another process)."""
    async with asyncio.timeout(seconds):
        while await conn.fetchval(sql) != expected:  # noqa: ASYNC110
            await asyncio.sleep(0.1)


APPLIED = "SELECT count(*) FROM ingest_command"


async def test_poison_and_foreign_commands_go_dead_while_the_next_applies_in_order(
    settings: RuntimeSettings,
    env: dict[str, str],
    conn: asyncpg.Connection[Any],
    producer: AIOKafkaProducer,
) -> None:
    topic = ingest_topic(TIER, settings.kafka_topic_prefix)
    acme = await Signer((await add_tenant(conn, "acme")).tenant_id).register(conn)
    beta = await Signer((await add_tenant(conn, "beta")).tenant_id).register(conn)
    first, last = uuid.uuid4(), uuid.uuid4()
    garbage = b"\xc3\x01 not a command"
    foreign = publish_command(beta.tenant_id, "page-1", b"acme writing into beta")
    unsigned = publish_command("acme", "page-1", b"nobody signed me")
    # One document's partition (same record key for all): the poison sits between two
    # publishes of the page.
    await send(
        producer,
        topic,
        acme,
        "acme",
        "page-1",
        publish_command("acme", "page-1", b"v1", command_id=first),
    )
    await send(producer, topic, acme, "acme", "page-1", garbage)
    await send(producer, topic, acme, "acme", "page-1", foreign)  # acme's key, beta's name
    await send(producer, topic, None, "acme", "page-1", unsigned)
    await send(
        producer,
        topic,
        acme,
        "acme",
        "page-1",
        publish_command("acme", "page-1", b"v2", command_id=last),
    )

    async with ingesting(env):
        await until(conn, APPLIED, 2)
    rows = await conn.fetch(
        "SELECT command_id, version_number FROM ingest_command ORDER BY version_number"
    )
    assert [(r["command_id"], r["version_number"]) for r in rows] == [(first, 1), (last, 2)]
    assert await conn.fetchval("SELECT count(*) FROM document WHERE tenant_id = 'beta'") == 0

    async with TopicReader(
        settings.kafka_bootstrap_servers, [ingest_dead_topic(TIER, settings.kafka_topic_prefix)]
    ) as reader:
        dead = await reader.read_to_end()
    assert [(d.value, d.headers["kb-problem-code"]) for d in dead] == [
        (garbage, "INGEST_COMMAND_UNDECODABLE"),
        (foreign, "INGEST_SIGNATURE_INVALID"),
        (unsigned, "INGEST_SIGNATURE_INVALID"),
    ]
    # Enough to replay: the original headers ride along with where it was read.
    assert dead[1].headers["kb-key-id"] == "k1"
    assert dead[1].headers["kb-source"].startswith(f"{topic}/")
    assert beta.key_id == "k1"


async def test_a_dead_letter_applies_once_replayed_after_its_cause_is_fixed(
    settings: RuntimeSettings,
    env: dict[str, str],
    conn: asyncpg.Connection[Any],
    producer: AIOKafkaProducer,
) -> None:
    topic = ingest_topic(TIER, settings.kafka_topic_prefix)
    await add_tenant(conn, "acme")
    later_key = Signer("acme", key_id="k2")  # signs before its key is registered
    command_id = uuid.uuid4()
    await send(
        producer,
        topic,
        later_key,
        "acme",
        "page-1",
        publish_command("acme", "page-1", command_id=command_id),
    )
    await send(producer, topic, later_key, "acme", "page-1", b"garbage")
    async with TopicReader(
        settings.kafka_bootstrap_servers, [ingest_dead_topic(TIER, settings.kafka_topic_prefix)]
    ) as reader:
        async with ingesting(env):
            await reader.read_until(lambda seen: len(seen) == 2)
        assert await conn.fetchval(APPLIED) == 0

        await later_key.register(conn)
        code, out, err = await kb_async(env, "ingest", "replay-dead", "--tier", TIER)
        assert code == 0, err
        assert out.strip() == "replayed=2"
        applied = await conn.fetchval("SELECT command_id FROM ingest_command")
        assert applied == command_id
        # The garbage is dead again, after the end the replay read to.
        await reader.read_until(lambda seen: len(seen) == 3)
        assert reader.messages[2].value == b"garbage"


async def test_a_consumer_killed_before_its_offset_commit_loses_and_duplicates_nothing(
    settings: RuntimeSettings,
    env: dict[str, str],
    conn: asyncpg.Connection[Any],
    producer: AIOKafkaProducer,
    tmp_path: Path,
) -> None:
    topic = ingest_topic(TIER, settings.kafka_topic_prefix)
    acme = await Signer((await add_tenant(conn, "acme")).tenant_id).register(conn)
    sent: list[uuid.UUID] = []
    pages = [f"page-{n}" for n in range(8)]
    for round_ in range(4):
        for page in pages:
            command_id = uuid.uuid4()
            sent.append(command_id)
            content = f"{page} version {round_ + 1}".encode()
            await send(
                producer,
                topic,
                acme,
                "acme",
                page,
                publish_command("acme", page, content, command_id=command_id),
            )
    for page in pages[:2]:
        command_id = uuid.uuid4()
        sent.append(command_id)
        await send(
            producer, topic, acme, "acme", page, delete_command("acme", page, command_id=command_id)
        )

    hang = tmp_path / "hang"
    async with ingesting(
        {**env, TEST_ONLY_HANG_BEFORE_COMMIT: str(hang), "KB_INGEST_BATCH_SIZE": "7"}
    ) as doomed:
        async with asyncio.timeout(60):
            while not hang.exists():  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        applied_before_kill = int(hang.read_text())
        assert applied_before_kill > 0
        assert await conn.fetchval(APPLIED) == applied_before_kill
        doomed.send_signal(signal.SIGKILL)
        await doomed.wait()

    async with ingesting(env):
        await until(conn, APPLIED, len(sent))

    recorded = [r["command_id"] for r in await conn.fetch("SELECT command_id FROM ingest_command")]
    assert sorted(recorded) == sorted(sent)
    # Every publish wrote exactly one version and one event naming its command.
    versions = await conn.fetch(
        "SELECT k.document_key, max(v.version_number) AS latest, count(*) AS versions "
        "FROM ingest_document_key k JOIN document_version v USING (tenant_id, document_id) "
        "GROUP BY k.document_key"
    )
    assert {(r["document_key"], r["latest"], r["versions"]) for r in versions} == {
        (page, 4, 4) for page in pages
    }
    named = await conn.fetch(
        "SELECT payload FROM outbox "
        "WHERE event_type IN ('DocumentVersionPublished', 'DocumentDeleted')"
    )
    command_ids = [
        default_registry().decode(bytes(r["payload"])).record["commandId"] for r in named
    ]
    assert sorted(command_ids) == sorted(sent)
    # In order: each page's version n is the content of its n-th command.
    for page in pages:
        text = await conn.fetchval(
            "SELECT convert_from(v.content, 'UTF8') FROM ingest_document_key k "
            "JOIN document_version v USING (tenant_id, document_id) "
            "WHERE k.document_key = $1 AND v.version_number = 3",
            page,
        )
        assert text == f"{page} version 3"
    assert os.environ.get(TEST_ONLY_HANG_BEFORE_COMMIT) is None


async def test_every_command_kind_applies_through_the_broker(
    settings: RuntimeSettings,
    env: dict[str, str],
    conn: asyncpg.Connection[Any],
    pool: asyncpg.Pool[Any],
    producer: AIOKafkaProducer,
) -> None:
    topic = ingest_topic(TIER, settings.kafka_topic_prefix)
    acme = await Signer((await add_tenant(conn, "acme")).tenant_id).register(conn)
    # A large file goes by reference: uploaded through the API's path first.
    store = PgPublisherStore(pool)
    upload = await Publisher(store, max_upload_bytes=1 << 20).create_document(
        "acme", "Big", Upload(b"big content", "text/plain", "big.txt")
    )
    commands = [
        ("page", publish_command("acme", "page", b"v1", read=["group:a"])),
        ("page", readers_command("acme", "page", ["group:b"])),
        ("big", publish_command("acme", "big", None, upload=(upload.document_id, 1))),
        ("gone", publish_command("acme", "gone", b"to delete")),
        ("gone", delete_command("acme", "gone")),
        ("secret", publish_command("acme", "secret", b"to erase")),
        ("secret", erase_command("acme", "secret")),
    ]
    for key, value in commands:
        await send(producer, topic, acme, "acme", key, value)
    async with ingesting(env):
        await until(conn, APPLIED, len(commands))
    kinds = await conn.fetch(
        "SELECT command_type, count(*) AS n FROM ingest_command GROUP BY 1 ORDER BY 1"
    )
    assert {r["command_type"]: r["n"] for r in kinds} == {
        "DeleteDocument": 1,
        "EraseDocument": 1,
        "PublishDocument": 4,
        "SetDocumentReaders": 1,
    }
    acl = await conn.fetchval(
        "SELECT array_agg(a.principal) FROM document_version_acl a "
        "JOIN ingest_document_key k USING (tenant_id, document_id) WHERE k.document_key = 'page'"
    )
    assert acl == ["group:b"]
    big = await conn.fetchval(
        "SELECT published_version FROM document WHERE document_id = $1", upload.document_id
    )
    assert big == 1
    states = await conn.fetch(
        "SELECT k.document_key, d.deleted_at IS NOT NULL, e.erased_at IS NOT NULL "
        "FROM ingest_document_key k JOIN document d USING (tenant_id, document_id) "
        "LEFT JOIN document_erasure e USING (tenant_id, document_id) "
        "WHERE k.document_key IN ('gone', 'secret') ORDER BY 1"
    )
    # The erased document's key is forgotten with it (it may be personal data).
    assert [tuple(r) for r in states] == [("gone", True, False)]
    erased = await conn.fetchrow(
        "SELECT d.deleted_at IS NOT NULL AS deleted, e.erased_at IS NOT NULL AS erased "
        "FROM ingest_command c JOIN document d USING (tenant_id, document_id) "
        "JOIN document_erasure e USING (tenant_id, document_id) "
        "WHERE c.command_type = 'EraseDocument'"
    )
    assert erased is not None
    assert (erased["deleted"], erased["erased"]) == (True, True)
    # Each command keeps when its record reached Kafka: the operator page's delay.
    unstamped = await conn.fetchval(
        "SELECT count(*) FROM ingest_command WHERE sent_at IS NULL OR sent_at > applied_at"
    )
    assert unstamped == 0


# --- runs of commands: one transaction, a savepoint each; tenants side by side ------------


async def _send(
    producer: AIOKafkaProducer, topic: str, signer: Signer, key: str, value: bytes
) -> None:
    """On partition 0, whatever the key: every command of the test shares one partition."""
    await producer.send_and_wait(
        topic,
        value,
        key=f"{signer.tenant_id}/{key}".encode(),
        headers=signer.headers(value),
        partition=0,
    )


async def test_a_poison_mid_run_is_dead_lettered_once_across_a_kill_and_redelivery(
    settings: RuntimeSettings,
    env: dict[str, str],
    conn: asyncpg.Connection[Any],
    producer: AIOKafkaProducer,
    tmp_path: Path,
) -> None:
    topic = ingest_topic(TIER, settings.kafka_topic_prefix)
    acme = await Signer((await add_tenant(conn, "acme")).tenant_id).register(conn)
    applied = [uuid.uuid4() for _ in range(10)]
    poison = uuid.uuid4()
    for n, command_id in enumerate(applied[:5]):
        await _send(
            producer, topic, acme, f"p{n}", publish_command("acme", f"p{n}", command_id=command_id)
        )
    # Signed and decodable, refused in its savepoint after its command id was claimed there.
    await _send(
        producer,
        topic,
        acme,
        "ghost",
        readers_command("acme", "ghost", ["group:all"], command_id=poison),
    )
    for n, command_id in enumerate(applied[5:], start=5):
        await _send(
            producer, topic, acme, f"p{n}", publish_command("acme", f"p{n}", command_id=command_id)
        )

    hang = tmp_path / "hang"
    one_run = {"KB_INGEST_BATCH_SIZE": "50", "KB_INGEST_APPLY_BATCH": "50"}
    async with ingesting({**env, **one_run, TEST_ONLY_HANG_BEFORE_COMMIT: str(hang)}) as doomed:
        async with asyncio.timeout(60):
            while not hang.exists():  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        assert int(hang.read_text()) == 11  # the ten applied and the poison, all done
        doomed.send_signal(signal.SIGKILL)
        await doomed.wait()
    assert await conn.fetchval(APPLIED) == 10

    # Redelivered from the last commit (none); a last command shows the run went through.
    last = uuid.uuid4()
    await _send(producer, topic, acme, "last", publish_command("acme", "last", command_id=last))
    async with ingesting({**env, **one_run}):
        await until(conn, APPLIED, 11)

    recorded = {r["command_id"] for r in await conn.fetch("SELECT command_id FROM ingest_command")}
    assert recorded == {*applied, last}
    assert await conn.fetchval("SELECT count(*) FROM document_version") == 11
    refusals = await conn.fetch("SELECT command_id, code FROM ingest_refusal")
    assert [(r["command_id"], r["code"]) for r in refusals] == [
        (poison, "INGEST_DOCUMENT_KEY_UNKNOWN")
    ]
    async with TopicReader(
        settings.kafka_bootstrap_servers, [ingest_dead_topic(TIER, settings.kafka_topic_prefix)]
    ) as reader:
        dead = await reader.read_to_end()
    assert [d.headers["kb-problem-code"] for d in dead] == ["INGEST_DOCUMENT_KEY_UNKNOWN"]


ACME_BACKLOG = "SELECT coalesce(sum(records), 0) FROM ingest_backlog WHERE tenant_id = 'acme'"


async def test_a_tenant_flooding_a_partition_does_not_hold_anothers_commands_behind_it(
    settings: RuntimeSettings,
    env: dict[str, str],
    conn: asyncpg.Connection[Any],
    database_url: str,
    producer: AIOKafkaProducer,
) -> None:
    topic = ingest_topic(TIER, settings.kafka_topic_prefix)
    acme = await Signer((await add_tenant(conn, "acme")).tenant_id).register(conn)
    beta = await Signer((await add_tenant(conn, "beta")).tenant_id).register(conn)
    small_runs = {**env, "KB_INGEST_APPLY_BATCH": "2", "KB_INGEST_BACKLOG_REPORT_SECONDS": "0.2"}
    async with ingesting(small_runs):
        await _send(producer, topic, acme, "page", publish_command("acme", "page", b"v1"))
        await until(conn, APPLIED, 1)
        # Acme's flood cannot apply while the test holds its document's row: every one of
        # its commands waits there. Beta's command, after the flood on the same partition,
        # must apply all the same.
        holder = await asyncpg.connect(database_url)
        try:
            lock = holder.transaction()
            await lock.start()
            await holder.execute("SELECT 1 FROM document WHERE tenant_id = 'acme' FOR UPDATE")
            for n in range(2, 12):
                content = f"v{n}".encode()
                await _send(producer, topic, acme, "page", publish_command("acme", "page", content))
            other = uuid.uuid4()
            await _send(producer, topic, beta, "c", publish_command("beta", "c", command_id=other))
            beta_applied = f"SELECT count(*) FROM ingest_command WHERE command_id = '{other}'"
            await until(conn, beta_applied, 1)
            acme_applied = "SELECT count(*) FROM ingest_command WHERE tenant_id = 'acme'"
            assert await conn.fetchval(acme_applied) == 1
            # The operator page's backlog: acme's ten, fetched and waiting.
            await until(conn, ACME_BACKLOG, 10)
            await lock.rollback()
        finally:
            await holder.close()
        await until(conn, APPLIED, 12)
        await until(conn, ACME_BACKLOG, 0)
    # Acme's commands applied in their order all the same.
    versions = await conn.fetch(
        "SELECT v.version_number, convert_from(v.content, 'UTF8') AS text "
        "FROM document_version v WHERE v.tenant_id = 'acme' ORDER BY v.version_number"
    )
    assert [(r["version_number"], r["text"]) for r in versions] == [
        (n, f"v{n}") for n in range(1, 12)
    ]


async def test_a_running_consumer_removes_the_refusals_past_their_horizon(
    conn: asyncpg.Connection[Any], env: dict[str, str], producer: AIOKafkaProducer
) -> None:
    await add_tenant(conn, "acme")
    for source, days in (("kb.ingest.standard/0/1", 40), ("kb.ingest.standard/0/2", 20)):
        await conn.execute(
            """INSERT INTO ingest_refusal (tenant_id, source, command_id, code, refused_at)
               VALUES ('acme', $1, $2, 'INGEST_COMMAND_INVALID',
                       now() - make_interval(days => $3))""",
            source,
            uuid.uuid4(),
            days,
        )
    async with ingesting({**env, "KB_INGEST_REFUSAL_RETENTION_DAYS": "30"}):
        await until(
            conn, "SELECT string_agg(source, ',') FROM ingest_refusal", "kb.ingest.standard/0/2"
        )
