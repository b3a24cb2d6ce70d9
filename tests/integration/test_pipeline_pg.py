"""The real pipeline under the Worker against PostgreSQL: published through the publisher's
API, indexed by ``run_once``, its status read back through the publisher's document query."""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import asyncpg
import httpx
import pytest

from services.embedding.factory import build_embedder
from services.embedding.settings import EmbeddingSettings, OpenAIConfig
from services.indexer.gc.collector import GarbageCollector, GcRound
from services.indexer.gc.settings import GcSettings
from services.indexer.pipeline.parsing.pool import ParsePool
from services.indexer.pipeline.source_pg import PgVersionSource
from services.indexer.ports import DocumentVersionIndexer
from services.indexer.queue.store_pg import PgTaskQueue
from services.indexer.queue.worker import RunOnceResult, Worker, WorkerEvent
from services.indexer.retry import RetryPolicy
from services.indexer.task import ErrorCode, IndexingFailed, Lease
from services.runtime.settings import RuntimeSettings
from tests.support.api import ApiTenant, add_tenant, publish, publisher_harness, upload
from tests.support.clock import ManualClock
from tests.support.documents import make_corrupt_pdf, make_large_pdf
from tests.support.embedding_provider import EmbeddingProvider, served_provider
from tests.support.pipeline import RecordingEmbedder, running_pipeline
from tests.support.tasks import create_task

pytestmark = pytest.mark.integration

MARKDOWN = "text/markdown"


def policy_document(paragraphs: int, changed: int | None = None) -> bytes:
    parts = ["# Refund policy"]
    for n in range(paragraphs):
        body = f"Clause {n}: refunds for order class {n} are granted within {n % 30 + 1} days."
        if n == changed:
            body = f"Clause {n}: refunds for order class {n} are NEVER granted, sorry."
        parts.append(f"## Section {n}\n\n{body}")
    return "\n\n".join(parts).encode()


class Api:
    """The publisher's HTTP API in-process, for one tenant."""

    def __init__(self, client: httpx.AsyncClient, tenant: ApiTenant) -> None:
        self.client = client
        self.tenant = tenant

    async def publish_new(
        self,
        content: bytes,
        *,
        media_type: str = MARKDOWN,
        filename: str = "refunds.md",
        document_id: uuid.UUID | None = None,
    ) -> tuple[uuid.UUID, int]:
        uploaded = await upload(
            self.client,
            self.tenant,
            content,
            media_type=media_type,
            filename=filename,
            document_id=document_id,
        )
        assert uploaded.status_code == 201, uploaded.text
        body = uploaded.json()
        published = await publish(
            self.client,
            self.tenant,
            body["documentId"],
            body["versionNumber"],
            body["revision"],
        )
        assert published.status_code == 202, published.text
        return uuid.UUID(body["documentId"]), body["versionNumber"]

    async def status(self, document_id: uuid.UUID) -> dict[str, Any]:
        answer = await self.client.get(
            self.tenant.path(f"/documents/{document_id}"), headers=self.tenant.headers
        )
        assert answer.status_code == 200, answer.text
        body: dict[str, Any] = answer.json()
        return body


@pytest.fixture
async def api(settings: RuntimeSettings, conn: asyncpg.Connection[Any]) -> AsyncIterator[Api]:
    tenant = await add_tenant(conn, "acme")
    async with publisher_harness(settings, max_upload_bytes=8 * 1024 * 1024) as harness:
        yield Api(harness.client, tenant)


def worker(pool: asyncpg.Pool[Any], indexer: DocumentVersionIndexer, **options: Any) -> Worker:
    return Worker(
        PgTaskQueue(pool, clock=options.pop("clock", None)),
        indexer,
        tier="standard",
        owner="it-pipeline",
        policy=options.pop("policy", RetryPolicy(jitter=0)),
        **options,
    )


async def chunk_versions(pool: asyncpg.Pool[Any], document_id: uuid.UUID) -> dict[int, int]:
    rows = await pool.fetch(
        "SELECT version_number, count(*) AS n FROM knowledge_chunk WHERE document_id = $1"
        " GROUP BY version_number ORDER BY version_number",
        document_id,
    )
    return {row["version_number"]: row["n"] for row in rows}


async def collect(pool: asyncpg.Pool[Any]) -> GcRound:
    """A round of the collector of superseded chunks, keeping nothing below what is served."""
    collector = GarbageCollector(pool, GcSettings(keep_previous=0, gc_batch_rows=1000))
    return await collector.collect(max_documents=100)


async def test_a_published_version_becomes_searchable(api: Api, pool: asyncpg.Pool[Any]) -> None:
    document_id, _ = await api.publish_new(policy_document(20))
    assert (await api.status(document_id))["indexStatus"] == "INDEXING"
    async with running_pipeline(pool) as indexer:
        assert await worker(pool, indexer).run_once() is RunOnceResult.SUCCEEDED
        assert await worker(pool, indexer).run_once() is RunOnceResult.IDLE
    status = await api.status(document_id)
    assert (status["indexStatus"], status["searchVersion"]) == ("SEARCHABLE", 1)
    rows = await pool.fetch(
        "SELECT ordinal, embedding_model, chunking_strategy, vector_dims(embedding) AS dims"
        "  FROM knowledge_chunk WHERE tenant_id = 'acme' AND document_id = $1"
        " ORDER BY ordinal",
        document_id,
    )
    assert [r["ordinal"] for r in rows] == list(range(len(rows)))
    assert len(rows) >= 20
    generation = indexer.generation
    assert {(r["embedding_model"], r["chunking_strategy"], r["dims"]) for r in rows} == {
        (generation.embedding_model, generation.chunking_strategy, generation.dimension)
    }


async def test_a_corrupt_v2_is_dead_and_v1_stays_searchable(
    api: Api, pool: asyncpg.Pool[Any]
) -> None:
    document_id, _ = await api.publish_new(policy_document(5))
    async with running_pipeline(pool) as indexer:
        assert await worker(pool, indexer).run_once() is RunOnceResult.SUCCEEDED
        await api.publish_new(
            make_corrupt_pdf(),
            media_type="application/pdf",
            filename="refunds.pdf",
            document_id=document_id,
        )
        assert await worker(pool, indexer).run_once() is RunOnceResult.FAILED
    status = await api.status(document_id)
    assert (status["indexStatus"], status["publishedVersion"], status["searchVersion"]) == (
        "FAILED",
        2,
        1,
    )
    assert status["failure"]["errorCode"] == ErrorCode.DOCUMENT_PARSE_FAILED
    task = await pool.fetchrow(
        "SELECT status, error_code FROM index_task WHERE document_id = $1 AND version_number = 2",
        document_id,
    )
    assert task is not None
    assert (task["status"], task["error_code"]) == ("DEAD", ErrorCode.DOCUMENT_PARSE_FAILED)
    assert list(await chunk_versions(pool, document_id)) == [1]


async def test_v2_reembeds_only_the_changed_paragraph(api: Api, pool: asyncpg.Pool[Any]) -> None:
    from services.embedding.hashing import HashingEmbedder

    recording = RecordingEmbedder(HashingEmbedder(dimension=64))
    document_id, _ = await api.publish_new(policy_document(200))
    async with running_pipeline(pool, embedder=recording, max_tokens=48) as indexer:
        assert await worker(pool, indexer).run_once() is RunOnceResult.SUCCEEDED
        v1_texts = len(recording.texts)
        v1_vectors = await vectors_by_ordinal(pool, document_id, 1)
        recording.requests.clear()
        await api.publish_new(policy_document(200, changed=42), document_id=document_id)
        assert await worker(pool, indexer).run_once() is RunOnceResult.SUCCEEDED
    # v2 switched and left v1 to the collector (its embeddings were reused first).
    assert await chunk_versions(pool, document_id) == {1: v1_texts, 2: v1_texts}
    assert await collect(pool) == GcRound(documents=1, chunks=v1_texts)
    assert await chunk_versions(pool, document_id) == {2: v1_texts}
    assert v1_texts >= 200
    assert 1 <= len(recording.texts) <= 3
    assert any("NEVER" in text for text in recording.texts)
    # The reused rows are v1's vectors, byte for byte.
    v2_vectors = await vectors_by_ordinal(pool, document_id, 2)
    same = sum(v2_vectors[ordinal] == vector for ordinal, vector in v1_vectors.items())
    assert same == v1_texts - len(recording.texts)
    assert (await api.status(document_id))["searchVersion"] == 2


async def vectors_by_ordinal(
    pool: asyncpg.Pool[Any], document_id: uuid.UUID, version: int
) -> dict[int, str]:
    rows = await pool.fetch(
        "SELECT ordinal, embedding::text AS vector FROM knowledge_chunk"
        " WHERE document_id = $1 AND version_number = $2",
        document_id,
        version,
    )
    return {row["ordinal"]: row["vector"] for row in rows}


async def _task(pool: asyncpg.Pool[Any], document_id: uuid.UUID, version: int) -> Any:
    return await pool.fetchrow(
        "SELECT status, error_code, attempts, next_attempt_at FROM index_task"
        " WHERE document_id = $1 AND version_number = $2",
        document_id,
        version,
    )


async def test_a_429_storm_keeps_v1_searchable_and_v2_switches_after_it(
    api: Api, pool: asyncpg.Pool[Any]
) -> None:
    clock = ManualClock(datetime.now(UTC))
    # Short backoffs: Retry-After (30 s) is what decides the waits.
    policy = RetryPolicy(
        backoff_base_seconds=1, backoff_cap_seconds=5, jitter=0, max_retry_after_seconds=60
    )
    with served_provider(EmbeddingProvider(dimension=64)) as served:
        settings = EmbeddingSettings(
            provider=OpenAIConfig(base_url=served.base_url, model="test-embed", dimensions=64)
        )
        embedder = build_embedder(settings)
        document_id, _ = await api.publish_new(policy_document(30))
        async with running_pipeline(pool, embedder=embedder) as indexer:
            run = worker(pool, indexer, clock=clock, policy=policy)
            clock.advance(1)  # the publisher's tasks are due by the database's clock
            assert await run.run_once() is RunOnceResult.SUCCEEDED  # v1, before the storm
            await api.publish_new(policy_document(30, changed=3), document_id=document_id)
            served.provider.inject("rate_limit", retry_after="30")  # until cleared
            clock.advance(1)
            for attempt in (1, 2):
                assert await run.run_once() is RunOnceResult.FAILED
                task = await _task(pool, document_id, 2)
                assert (task["status"], task["error_code"], task["attempts"]) == (
                    "RETRY_WAIT",
                    ErrorCode.EMBEDDING_RATE_LIMITED,
                    attempt,
                )
                assert (task["next_attempt_at"] - clock.now()).total_seconds() == 30
                status = await api.status(document_id)
                assert (status["indexStatus"], status["searchVersion"]) == ("INDEXING", 1)
                clock.advance(29)
                assert await run.run_once() is RunOnceResult.IDLE  # Retry-After respected
                clock.advance(1)
            served.provider.clear_faults()  # the storm is over
            assert await run.run_once() is RunOnceResult.SUCCEEDED
        faults = [request.fault for request in served.provider.requests]
    assert faults.count("rate_limit") == 2
    status = await api.status(document_id)
    assert (status["indexStatus"], status["searchVersion"]) == ("SEARCHABLE", 2)
    # v1 is left to the collector by the switch, then collected.
    assert set(await chunk_versions(pool, document_id)) == {1, 2}
    assert (await collect(pool)).documents == 1
    assert set(await chunk_versions(pool, document_id)) == {2}


@pytest.mark.parametrize(
    ("options", "code"),
    [
        ({"stored_sha256": hashlib.sha256(b"other").digest()}, ErrorCode.DOCUMENT_PARSE_FAILED),
        ({"stored_size": 3}, ErrorCode.DOCUMENT_PARSE_FAILED),
        ({"media_type": "image/png"}, ErrorCode.UNSUPPORTED_DOCUMENT),
    ],
)
async def test_a_bad_stored_version_is_dead_with_a_stable_code(
    pool: asyncpg.Pool[Any], options: dict[str, Any], code: str
) -> None:
    created = await create_task(pool, **options)
    async with running_pipeline(pool) as indexer:
        assert await worker(pool, indexer).run_once() is RunOnceResult.FAILED
    row = await pool.fetchrow(
        "SELECT status, error_code FROM index_task WHERE task_id = $1", created.task_id
    )
    assert row is not None
    assert (row["status"], row["error_code"]) == ("DEAD", code)
    assert await chunk_versions(pool, created.document_id) == {}


async def test_the_version_is_loaded_tenant_scoped(pool: asyncpg.Pool[Any]) -> None:
    created = await create_task(pool, tenant_id="acme")
    source = PgVersionSource(pool)
    assert await source.load("acme", created.document_id, 1) is not None
    # The right document id, another tenant: nothing.
    assert await source.load("globex", created.document_id, 1) is None
    foreign = Lease(
        task_id=created.task_id,
        owner="x",
        lease_attempt=1,
        lease_until=datetime.now(UTC),
        tenant_id="globex",
        document_id=created.document_id,
        version_number=1,
        task_type="INDEX_VERSION",
        tier="standard",
        max_attempts=8,
    )
    async with running_pipeline(pool) as indexer:
        with pytest.raises(IndexingFailed) as raised:
            await indexer.index(foreign)
    assert raised.value.code == ErrorCode.DOCUMENT_VERSION_MISSING


class SignallingParsePool(ParsePool):
    """The real process pool, telling the test when a parse starts and ends."""

    def __init__(self, signals: asyncio.Queue[WorkerEvent]) -> None:
        super().__init__(workers=1)
        self.signals = signals

    async def stream_chunks(self, *args: Any, **kwargs: Any) -> Any:
        self.signals.put_nowait(WorkerEvent("parse_started"))
        try:
            return await super().stream_chunks(*args, **kwargs)
        finally:
            self.signals.put_nowait(WorkerEvent("parse_finished"))


async def test_heartbeats_keep_their_schedule_while_a_big_pdf_is_parsed(
    api: Api, pool: asyncpg.Pool[Any]
) -> None:
    # Long enough to parse for several heartbeat periods even with the parse process's
    # imports warm in the page cache (80 pages were not, in a full run of the suite).
    big = make_large_pdf(pages=400)
    document_id, _ = await api.publish_new(big, media_type="application/pdf", filename="big.pdf")
    signals: asyncio.Queue[WorkerEvent] = asyncio.Queue()
    # A worker process parses it: the event loop stays free to heartbeat.
    async with running_pipeline(pool, parse_pool=SignallingParsePool(signals)) as indexer:
        # 1.5 s: a loop blocked by the parse (seconds) still loses it, while one heartbeat
        # statement slowed by a busy server (0.6 s was lost so, once, in a full CI run) does not.
        result = await worker(pool, indexer, lease_seconds=1.5, signals=signals).run_once()
    events = [signals.get_nowait().kind for _ in range(signals.qsize())]
    assert result is RunOnceResult.SUCCEEDED, events
    during_parse = events[events.index("parse_started") : events.index("parse_finished")]
    # Parsing 400 pages outlasts several 0.5 s heartbeat periods, and every beat held the
    # lease (a loop blocked for longer than the 1.5 s lease would have lost it).
    assert during_parse.count("heartbeat") >= 3, events
    assert "lease_lost" not in events
    task = await pool.fetchrow(
        "SELECT status, attempts FROM index_task WHERE document_id = $1", document_id
    )
    assert task is not None
    assert (task["status"], task["attempts"]) == ("SUCCEEDED", 1)
