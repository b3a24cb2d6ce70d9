"""A model migration as an operator runs it, with a searcher looping all along: `kb serve`
and `kb indexer run` as processes, then `kb index generations create` (a backfill into a
second generation -- another model and other chunk settings -- with publishes indexed into
both meanwhile), `switch`, `switch` back (the rollback) and `retire`. Every answer must
hold hits for a query that had hits, name one generation and hold only its chunks, and
never serve a document at a version older than one it served before."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from tests.e2e.test_searchable import started, tail, wait_ready
from tests.support.api import free_port
from tests.support.stack import REPO_ROOT

pytestmark = pytest.mark.e2e

KB = [sys.executable, "-m", "services.cli"]
WITHIN = 180.0
SERVING_MODEL = "hashing-v1-64"
NEXT_MODEL = "hashing-v1-32"
TOPICS = [
    "refunds",
    "holidays",
    "laptops",
    "expenses",
    "parking",
    "security",
    "onboarding",
    "payroll",
    "travel",
    "benefits",
]


def kb(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*KB, *args], env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )


def document_text(topic: str, version: int) -> bytes:
    return (
        f"# {topic.title()} policy\n\n"
        f"The {topic} rules, revision {version}: ask the {topic} desk before you act.\n"
    ).encode()


@dataclass
class Watch:
    """What the searcher saw."""

    answers: int = 0
    models: set[str] = field(default_factory=set)
    violations: list[str] = field(default_factory=list)
    served: dict[str, int] = field(default_factory=dict)
    answered: asyncio.Condition = field(default_factory=asyncio.Condition)

    async def count(self) -> None:
        async with self.answered:
            self.answers += 1
            self.answered.notify_all()

    async def more(self, answers: int) -> None:
        """Until the searcher has answered ``answers`` more queries."""
        target = self.answers + answers
        async with asyncio.timeout(WITHIN), self.answered:
            await self.answered.wait_for(lambda: self.answers >= target)


async def searcher(
    client: httpx.AsyncClient,
    conn: asyncpg.Connection[Any],
    documents: dict[str, str],
    watch: Watch,
    stop: asyncio.Event,
) -> None:
    while not stop.is_set():
        for topic, document_id in documents.items():
            answer = await client.post(
                "/v1/tenants/acme/search",
                json={"query": f"{topic} desk", "topK": 5, "principals": ["group:all"]},
            )
            if answer.status_code != 200:
                watch.violations.append(f"{topic}: HTTP {answer.status_code} {answer.text}")
                continue
            body = answer.json()
            await watch.count()
            model = body["generation"]["embeddingModel"]
            watch.models.add(model)
            hits = [hit for hit in body["results"] if hit["documentId"] == document_id]
            if not hits:
                watch.violations.append(f"{topic}: no hit of its document under {model}")
                continue
            chunk_models = {
                row["embedding_model"]
                for row in await conn.fetch(
                    "SELECT DISTINCT embedding_model FROM knowledge_chunk"
                    " WHERE tenant_id = 'acme' AND chunk_id = ANY($1::text[])",
                    [hit["chunkId"] for hit in body["results"]],
                )
            }
            if chunk_models - {model}:
                watch.violations.append(f"{topic}: chunks of {chunk_models} under {model}")
            version = max(hit["versionNumber"] for hit in hits)
            if version < watch.served.get(document_id, 0):
                watch.violations.append(
                    f"{topic}: version {version} after {watch.served[document_id]}"
                )
            watch.served[document_id] = max(version, watch.served.get(document_id, 0))


async def publish(client: httpx.AsyncClient, topic: str, document_id: str | None) -> str:
    files = {"file": (f"{topic}.md", document_text(topic, 1), "text/markdown")}
    if document_id is None:
        uploaded = await client.post(
            "/v1/tenants/acme/documents", files=files, data={"title": topic.title()}
        )
    else:
        current = (await client.get(f"/v1/tenants/acme/documents/{document_id}")).json()
        version = current["latestVersion"] + 1
        files = {"file": (f"{topic}.md", document_text(topic, version), "text/markdown")}
        uploaded = await client.post(
            f"/v1/tenants/acme/documents/{document_id}/versions", files=files
        )
    assert uploaded.status_code == 201, uploaded.text
    body = uploaded.json()
    published = await client.post(
        f"/v1/tenants/acme/documents/{body['documentId']}/versions/{body['versionNumber']}/publish",
        json={"revision": body["revision"], "acl": {"read": ["group:all"]}},
    )
    assert published.status_code == 202, published.text
    return str(body["documentId"])


async def wait_searchable(
    client: httpx.AsyncClient, document_id: str, version: int, watched: list[Any]
) -> None:
    async with asyncio.timeout(WITHIN):
        while True:
            for process, log in watched:
                assert process.poll() is None, f"a service exited: {tail(log)}"
            body = (await client.get(f"/v1/tenants/acme/documents/{document_id}")).json()
            if body["indexStatus"] == "SEARCHABLE" and body["searchVersion"] >= version:
                return
            await asyncio.sleep(0.1)


def generations_status(env: dict[str, str]) -> list[dict[str, Any]]:
    done = kb(env, "index", "generations", "status", "--tenant", "acme", "--json")
    assert done.returncode == 0, done.stderr
    parsed: list[dict[str, Any]] = json.loads(done.stdout)
    return parsed


async def wait_built(env: dict[str, str], generation: int, documents: int) -> None:
    async with asyncio.timeout(WITHIN):
        while True:
            for row in generations_status(env):
                if row["generationId"] == generation and row["done"] == documents:
                    return
            await asyncio.sleep(0.5)


@pytest.fixture
def loop_env(service_env: dict[str, str]) -> dict[str, str]:
    return {
        **service_env,
        "KB_INDEXER_POLL_SECONDS": "0.2",
        "KB_EMBEDDING_PROVIDER": "hashing",
        "KB_EMBEDDING_DIMENSIONS": "64",
        "KB_EMBEDDING_PROFILE_NEXT_PROVIDER": "hashing",
    }


async def test_create_backfill_switch_rollback_retire_under_a_searcher(
    loop_env: dict[str, str], conn: asyncpg.Connection[Any], tmp_path: Path
) -> None:
    env = loop_env
    created = kb(env, "tenants", "create", "acme", "--tier", "standard")
    assert created.returncode == 0, created.stderr
    key = created.stdout.strip().removeprefix("KB_API_KEY=")
    port = free_port()
    root = f"http://127.0.0.1:{port}"

    with ExitStack() as services:
        logs = {name: tmp_path / f"{name}.log" for name in ("serve", "indexer")}
        server = services.enter_context(
            started(env, logs["serve"], "serve", "--host", "127.0.0.1", "--port", str(port))
        )
        indexer = services.enter_context(
            started(env, logs["indexer"], "indexer", "run", "--tier", "standard")
        )
        watched = [(server, logs["serve"]), (indexer, logs["indexer"])]
        await wait_ready(root, server, logs["serve"])
        headers = {"Authorization": f"Bearer {key}"}
        async with httpx.AsyncClient(base_url=root, headers=headers, timeout=30) as client:
            documents = {topic: await publish(client, topic, None) for topic in TOPICS}
            for document_id in documents.values():
                await wait_searchable(client, document_id, 1, watched)

            watch, stop = Watch(), asyncio.Event()
            looping = asyncio.create_task(searcher(client, conn, documents, watch, stop))
            try:
                made = kb(
                    env, "index", "generations", "create", "--provider", "next",
                    "--model", NEXT_MODEL, "--dimensions", "32", "--chunk-tokens", "128",
                    "--tenant", "acme",
                )  # fmt: skip
                assert made.returncode == 0, made.stderr
                generation = int(made.stdout.split()[-1])
                # Published during the backfill: indexed into both generations.
                await publish(client, "refunds", documents["refunds"])
                await wait_searchable(client, documents["refunds"], 2, watched)
                await wait_built(env, generation, len(TOPICS))

                switched = kb(env, "index", "generations", "switch", "--tenant", "acme",
                              "--to", str(generation))  # fmt: skip
                assert switched.returncode == 0, switched.stderr
                await watch.more(2 * len(TOPICS))
                assert NEXT_MODEL in watch.models

                # Published while the new generation serves: the old one keeps up (rollback).
                await publish(client, "parking", documents["parking"])
                await wait_searchable(client, documents["parking"], 2, watched)
                [old] = [
                    row["generationId"]
                    for row in generations_status(env)
                    if row["embeddingModel"] == SERVING_MODEL
                ]
                await wait_built(env, old, len(TOPICS))
                rolled_back = kb(env, "index", "generations", "switch", "--tenant", "acme",
                                 "--to", str(old))  # fmt: skip
                assert rolled_back.returncode == 0, rolled_back.stderr
                await watch.more(2 * len(TOPICS))

                retired = kb(env, "index", "generations", "retire", str(generation))
                assert retired.returncode == 0, retired.stderr
                await watch.more(len(TOPICS))
            finally:
                stop.set()
                await looping

    assert watch.violations == []
    assert watch.models == {SERVING_MODEL, NEXT_MODEL}
    assert watch.served[documents["parking"]] == 2
    left = await conn.fetchval(
        "SELECT count(*) FROM knowledge_chunk WHERE embedding_model = $1", NEXT_MODEL
    )
    assert left == 0
    assert uuid.UUID(documents["refunds"])
