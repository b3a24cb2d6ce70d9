"""`kb index check [--repair]` as an operator runs it, against drift made by hand the way a
restore from backup or a hand-edited row would make it."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import httpx
import pytest

from services.indexer.queue.store_pg import PgTaskQueue
from services.indexer.queue.task import RetryPolicy
from services.indexer.queue.worker import RunOnceResult, Worker
from services.runtime.settings import RuntimeSettings
from tests.support.api import ApiTenant, add_tenant, publish, publisher_harness, upload
from tests.support.cli import kb
from tests.support.documents import make_corrupt_pdf
from tests.support.pipeline import running_pipeline

pytestmark = pytest.mark.integration


def policy(name: str, sections: int = 6) -> bytes:
    parts = [f"# {name} policy"]
    parts += [
        f"## Part {n}\n\nRule {n} of the {name} policy holds for {n + 2} days."
        for n in range(sections)
    ]
    return "\n\n".join(parts).encode()


class Publisher:
    def __init__(self, client: httpx.AsyncClient, tenant: ApiTenant) -> None:
        self.client = client
        self.tenant = tenant

    async def publish(
        self,
        content: bytes,
        *,
        document_id: uuid.UUID | None = None,
        media_type: str = "text/markdown",
    ) -> uuid.UUID:
        uploaded = await upload(
            self.client,
            self.tenant,
            content,
            media_type=media_type,
            filename="p",
            document_id=document_id,
        )
        assert uploaded.status_code == 201, uploaded.text
        body = uploaded.json()
        published = await publish(
            self.client, self.tenant, body["documentId"], body["versionNumber"], body["revision"]
        )
        assert published.status_code == 202, published.text
        return uuid.UUID(body["documentId"])


@pytest.fixture
async def publisher(
    settings: RuntimeSettings, conn: asyncpg.Connection[Any]
) -> AsyncIterator[Publisher]:
    tenant = await add_tenant(conn, "acme")
    async with publisher_harness(settings) as harness:
        yield Publisher(harness.client, tenant)


async def index_all(pool: asyncpg.Pool[Any]) -> list[RunOnceResult]:
    """Run tasks until none is due; the results in order."""
    results: list[RunOnceResult] = []
    async with running_pipeline(pool) as indexer:
        worker = Worker(
            PgTaskQueue(pool),
            indexer,
            tier="standard",
            owner="it-check",
            policy=RetryPolicy(jitter=0),
        )
        while (result := await worker.run_once()) is not RunOnceResult.IDLE:
            results.append(result)
    return results


async def served(pool: asyncpg.Pool[Any], document_id: uuid.UUID) -> tuple[int | None, int]:
    version = await pool.fetchval(
        "SELECT version_number FROM document_search_version WHERE document_id = $1", document_id
    )
    chunks = await pool.fetchval(
        "SELECT count(*) FROM knowledge_chunk WHERE document_id = $1 AND version_number = $2",
        document_id,
        version,
    )
    return version, chunks


async def test_check_names_each_drifted_document_and_repair_makes_them_searchable(
    publisher: Publisher, pool: asyncpg.Pool[Any], service_env: dict[str, str]
) -> None:
    healthy = await publisher.publish(policy("travel"))
    damaged = await publisher.publish(policy("refund"))
    unserved = await publisher.publish(policy("privacy"))
    failed = await publisher.publish(policy("warranty"))
    assert await index_all(pool) == [RunOnceResult.SUCCEEDED] * 4
    await publisher.publish(make_corrupt_pdf(), document_id=failed, media_type="application/pdf")
    assert await index_all(pool) == [RunOnceResult.FAILED]
    unqueued = await publisher.publish(policy("shipping"))
    indexing = await publisher.publish(policy("remote work"))
    healthy_before = await served(pool, healthy)
    damaged_chunks = (await served(pool, damaged))[1]

    # The drift a restore or a hand edit leaves behind.
    await pool.execute(
        "DELETE FROM knowledge_chunk WHERE document_id = $1 AND ordinal % 2 = 0", damaged
    )
    await pool.execute("DELETE FROM document_search_version WHERE document_id = $1", unserved)
    await pool.execute("DELETE FROM index_task WHERE document_id = $1", unqueued)

    found = kb(service_env, "index", "check")
    assert found.returncode == 1, found.stderr
    lines = sorted(found.stdout.splitlines())
    assert [line.split()[:3] for line in lines] == sorted(
        [
            ["CHUNKS_MISSING", "acme", str(damaged)],
            ["SUCCEEDED_NOT_SERVED", "acme", str(unserved)],
            ["NOT_QUEUED", "acme", str(unqueued)],
        ]
    )
    # A FAILED version (task DEAD) and one being indexed are not drift; neither is the
    # healthy document.
    for quiet in (healthy, failed, indexing):
        assert str(quiet) not in found.stdout
    assert "6 documents, 3 drifted, 0 repaired" in found.stderr
    assert kb(service_env, "index", "check", "--tenant", "acme").stdout == found.stdout

    repaired = kb(service_env, "index", "check", "--repair")
    assert repaired.returncode == 0, repaired.stdout + repaired.stderr
    assert repaired.stdout.count("REPAIRED task=") == 3
    assert "3 drifted, 3 repaired" in repaired.stderr
    # The re-run of the damaged document's task is on record beside operators' requeues.
    audit = await pool.fetchval(
        "SELECT requeued_by FROM index_task_requeue r JOIN index_task t USING (task_id)"
        " WHERE t.document_id = $1",
        damaged,
    )
    assert audit == "kb index check --repair"

    # Three repaired tasks and the one being indexed run; nothing else does.
    assert await index_all(pool) == [RunOnceResult.SUCCEEDED] * 4
    clean = kb(service_env, "index", "check")
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert clean.stdout == ""
    assert "0 drifted" in clean.stderr
    assert await served(pool, damaged) == (1, damaged_chunks)
    assert await served(pool, unserved) == (1, (await served(pool, unserved))[1])
    assert (await served(pool, unserved))[1] > 0
    assert (await served(pool, unqueued))[0] == 1
    assert await served(pool, healthy) == healthy_before
    # The failed version stays failed, its v1 served.
    assert (await served(pool, failed))[0] == 1


async def test_a_pointer_ahead_of_the_published_version_is_left_to_an_operator(
    publisher: Publisher, pool: asyncpg.Pool[Any], service_env: dict[str, str]
) -> None:
    document_id = await publisher.publish(policy("travel"))
    assert await index_all(pool) == [RunOnceResult.SUCCEEDED]
    await pool.execute(
        "UPDATE document SET published_version = NULL WHERE document_id = $1", document_id
    )

    repaired = kb(service_env, "index", "check", "--repair")
    assert repaired.returncode == 1, repaired.stderr
    [line] = repaired.stdout.splitlines()
    assert line.startswith(f"POINTER_AHEAD  acme  {document_id}")
    assert "NOT_REPAIRED" in line


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tenant", "Acme Corp"], "tenant 'Acme Corp'"),
        (["--tenant", "nobody"], "no tenant 'nobody'"),
    ],
)
async def test_bad_tenants_exit_2_and_change_nothing(
    publisher: Publisher,
    pool: asyncpg.Pool[Any],
    service_env: dict[str, str],
    args: list[str],
    message: str,
) -> None:
    await publisher.publish(policy("travel"))
    await pool.execute("DELETE FROM index_task")
    result = kb(service_env, "index", "check", "--repair", *args)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stdout == ""
    assert message in result.stderr
    assert await pool.fetchval("SELECT count(*) FROM index_task") == 0
