"""`kb index check [--repair]` as an operator runs it, against drift made by hand the way a
restore from backup or a hand-edited row would make it, and against documents chunked by
older code than the indexers now run. The repairs' tasks run on a real worker and pipeline
while `kb index check --repair` waits for them."""

from __future__ import annotations

import asyncio
import subprocess
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import httpx
import pytest
from semchunk.semchunk import chunk as semchunk_chunk

from services.indexer.pipeline import chunking, chunking_code
from services.indexer.queue.store_pg import PgTaskQueue
from services.indexer.queue.worker import RunOnceResult, Worker
from services.indexer.retry import RetryPolicy
from services.runtime.settings import RuntimeSettings
from tests.support.api import ApiTenant, add_tenant, publish, publisher_harness, upload
from tests.support.cli import kb, kb_async
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


async def kb_while_indexing(
    pool: asyncpg.Pool[Any], env: dict[str, str], *args: str
) -> subprocess.CompletedProcess[str]:
    """`kb *args` in a child process, with a worker running the pipeline meanwhile (as the
    indexers of a deployment would); the worker stops once the command has exited."""
    async with running_pipeline(pool) as indexer:
        worker = Worker(
            PgTaskQueue(pool),
            indexer,
            tier="standard",
            owner="it-check-worker",
            policy=RetryPolicy(jitter=0),
            poll_interval_seconds=0.1,
        )
        stop = asyncio.Event()
        working = asyncio.create_task(worker.run(stop))
        try:
            returncode, out, err = await kb_async(env, *args, seconds=120)
        finally:
            stop.set()
            await working
    return subprocess.CompletedProcess(list(args), returncode, out, err)


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

    # The repairs' three tasks and the one being indexed run while the command waits; each
    # drift counts as repaired once the check after its task no longer finds it.
    repaired = await kb_while_indexing(pool, service_env, "index", "check", "--repair")
    assert repaired.returncode == 0, repaired.stdout + repaired.stderr
    outcomes = sorted(line.split("  ->  ")[1].split()[0] for line in repaired.stdout.splitlines())
    assert outcomes == ["REPAIRED"] * 3, repaired.stdout
    assert "3 drifted, 3 repaired, 0 left" in repaired.stderr
    # The re-run of the damaged document's task is on record beside operators' requeues.
    audit = await pool.fetchval(
        "SELECT requeued_by FROM index_task_requeue r JOIN index_task t USING (task_id)"
        " WHERE t.document_id = $1",
        damaged,
    )
    assert audit == "kb index check --repair"
    # Nothing else is left to run but the document being indexed, if the worker stopped
    # before it got to it.
    assert await index_all(pool) in ([], [RunOnceResult.SUCCEEDED])
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


def long_policy(name: str) -> bytes:
    """One long section: several chunks, cut otherwise by a chunker of other chunk sizes."""
    sentences = " ".join(
        f"Clause {n} of the {name} policy allows {n + 3} days for a claim." for n in range(40)
    )
    return f"# {name} policy\n\n## Claims\n\n{sentences}\n".encode()


async def chunkings(pool: asyncpg.Pool[Any], document_id: uuid.UUID) -> list[tuple[str, int]]:
    """The document's chunk sets of its served version: (strategy, chunks) each."""
    rows = await pool.fetch(
        "SELECT c.chunking_strategy, count(*)::int AS n"
        "  FROM knowledge_chunk c JOIN document_search_version s USING (document_id)"
        " WHERE c.document_id = $1 AND c.version_number = s.version_number"
        " GROUP BY c.chunking_strategy",
        document_id,
    )
    return [(row["chunking_strategy"], row["n"]) for row in rows]


async def test_documents_chunked_by_older_code_are_named_and_repair_chunks_them_again(
    publisher: Publisher,
    pool: asyncpg.Pool[Any],
    service_env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The documents are indexed by an older chunker: version 0 of ours, which cut chunks of
    # half the size the settings ask for.
    older = chunking_code.CHUNKER_VERSION - 1

    def older_split(text: str, chunk_size: int, **options: Any) -> Any:
        return semchunk_chunk(text, chunk_size=chunk_size // 2, **options)

    with monkeypatch.context() as patched:
        patched.setattr(chunking_code, "CHUNKER_VERSION", older)
        patched.setattr(chunking, "semchunk_chunk", older_split)
        documents = [await publisher.publish(long_policy(name)) for name in ("travel", "refund")]
        assert await index_all(pool) == [RunOnceResult.SUCCEEDED] * 2
    before = {d: await chunkings(pool, d) for d in documents}
    assert kb(service_env, "index", "check").returncode == 0

    # The indexers are upgraded: starting one registers its generation, and the served
    # documents are now chunked by older code.
    found = await kb_while_indexing(pool, service_env, "index", "check")
    assert found.returncode == 1, found.stdout + found.stderr
    assert sorted(line.split()[:3] for line in found.stdout.splitlines()) == sorted(
        ["OLDER_CHUNKING", "acme", str(d)] for d in documents
    )
    assert f"chunked by older code (chunker {older} -> {older + 1})" in found.stdout

    repaired = await kb_while_indexing(pool, service_env, "index", "check", "--repair")
    assert repaired.returncode == 0, repaired.stdout + repaired.stderr
    assert repaired.stdout.count("->  REPAIRED task=") == 2, repaired.stdout
    assert "2 drifted, 2 repaired, 0 left" in repaired.stderr

    clean = kb(service_env, "index", "check")
    assert clean.returncode == 0, clean.stdout + clean.stderr
    for document in documents:
        # One chunking served, the newer code's: bigger chunks, so fewer of them.
        [(strategy, chunks)] = await chunkings(pool, document)
        [(old_strategy, old_chunks)] = before[document]
        assert strategy != old_strategy
        assert chunks < old_chunks
        assert (
            await pool.fetchval(
                "SELECT count(*) FROM knowledge_chunk WHERE document_id = $1", document
            )
            == chunks
        )
        current = await pool.fetchrow(
            "SELECT version_number, chunking_strategy, chunk_count FROM document_search_version"
            " WHERE document_id = $1",
            document,
        )
        assert current is not None
        assert (current["version_number"], current["chunking_strategy"]) == (1, strategy)
        assert current["chunk_count"] == chunks


async def test_a_repair_whose_task_does_not_finish_in_time_is_not_counted(
    publisher: Publisher, pool: asyncpg.Pool[Any], service_env: dict[str, str]
) -> None:
    document_id = await publisher.publish(policy("travel"))
    await pool.execute("DELETE FROM index_task WHERE document_id = $1", document_id)

    # No indexer runs: the task is created and never finishes.
    waited = kb(service_env, "index", "check", "--repair", "--timeout", "0.5")
    assert waited.returncode == 1, waited.stdout + waited.stderr
    [line] = waited.stdout.splitlines()
    assert line.startswith(f"NOT_QUEUED  acme  {document_id}")
    assert "->  NOT_FINISHED task=" in line
    assert "1 drifted, 0 repaired, 1 left" in waited.stderr
    # A check now finds nothing to say (the task is live), yet the repair was not verified.
    assert kb(service_env, "index", "check").returncode == 0

    # Without a wait nothing is verified either.
    await pool.execute("DELETE FROM index_task WHERE document_id = $1", document_id)
    queued = kb(service_env, "index", "check", "--repair", "--timeout", "0")
    assert queued.returncode == 1, queued.stdout + queued.stderr
    assert "->  NOT_VERIFIED task=" in queued.stdout
    assert "waiting" not in queued.stderr


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
