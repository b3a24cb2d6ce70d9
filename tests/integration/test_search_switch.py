"""A search running across search-pointer switches sees each document at one version: every
answer is all old or all new (docs/architecture.md#invariants), in every mode."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from services.runtime.settings import RuntimeSettings
from services.search.statements import VectorPath
from tests.support.api import ApiTenant, add_tenant
from tests.support.search import (
    ChunkSpec,
    SearchHarness,
    add_document,
    add_version,
    create_ann_index,
    point_search_at,
    search_harness,
)

pytestmark = pytest.mark.integration

DOCUMENTS = 4
VERSIONS = 5
CHUNKS = 12
ANSWERS_AFTER_EACH_SWITCH = 3


# Every test on both paths of the vector list: walking the tenant partition's HNSW index,
# and ranking every readable chunk exactly.
@pytest.fixture(params=[VectorPath.ANN, VectorPath.EXACT], ids=["ann", "exact"])
async def api(
    settings: RuntimeSettings, request: pytest.FixtureRequest
) -> AsyncIterator[SearchHarness]:
    async with search_harness(settings, pool_size=8, vector_path=request.param) as harness:
        await create_ann_index(harness.pool, harness.embedder.model, harness.embedder.dimension)
        yield harness


@pytest.fixture
async def acme(conn: asyncpg.Connection[Any]) -> ApiTenant:
    return await add_tenant(conn, "acme", "standard")


async def test_answers_never_mix_versions_across_pointer_switches(
    api: SearchHarness, acme: ApiTenant, conn: asyncpg.Connection[Any], database_url: str
) -> None:
    documents = [await add_document(conn, "acme", title=f"Policy {d}") for d in range(DOCUMENTS)]
    for document_id in documents:
        for version in range(1, VERSIONS + 1):
            chunks = [
                ChunkSpec(f"refund clause {n} of version {version}", ("Refunds",))
                for n in range(CHUNKS)
            ]
            await add_version(conn, "acme", document_id, version, chunks, api.embedder)
        await point_search_at(conn, "acme", document_id, 1, api.embedder.model)

    answers: list[tuple[int, set[int]]] = []  # (switches done before the answer, versions)
    switches_done = 0
    answered = asyncio.Queue[None]()
    stop = asyncio.Event()

    async def searcher(mode: str) -> None:
        while not stop.is_set():
            before = switches_done
            response = await api.search(
                acme,
                {"query": "refund clause", "principals": ["group:all"], "mode": mode, "topK": 100},
            )
            assert response.status_code == 200, response.text
            results = response.json()["results"]
            # Complete: every chunk of every document's one version, never a part.
            assert len(results) == DOCUMENTS * CHUNKS, mode
            answers.append((before, {r["versionNumber"] for r in results}))
            answered.put_nowait(None)

    async def switcher() -> None:
        nonlocal switches_done
        switch_conn = await asyncpg.connect(database_url)
        try:
            for version in range(2, VERSIONS + 1):
                for _ in range(ANSWERS_AFTER_EACH_SWITCH):
                    await answered.get()
                # Every document moves in one transaction, as one generation switch would.
                async with switch_conn.transaction():
                    for document_id in documents:
                        await point_search_at(
                            switch_conn, "acme", document_id, version, api.embedder.model
                        )
                switches_done += 1
            for _ in range(ANSWERS_AFTER_EACH_SWITCH):
                await answered.get()
        finally:
            await switch_conn.close()
            stop.set()

    await asyncio.gather(searcher("hybrid"), searcher("vector"), searcher("keyword"), switcher())

    assert len(answers) >= (VERSIONS - 1) * ANSWERS_AFTER_EACH_SWITCH
    for before, versions in answers:
        assert len(versions) == 1, versions
        (version,) = versions
        # Never older than the last switch committed before the search started.
        assert version >= before + 1
    assert {v for _, versions in answers for v in versions} > {1}

    for mode in ("hybrid", "vector", "keyword"):
        final = (
            await api.search(
                acme,
                {"query": "refund clause", "principals": ["group:all"], "mode": mode, "topK": 100},
            )
        ).json()["results"]
        assert final
        assert {r["versionNumber"] for r in final} == {VERSIONS}, mode
