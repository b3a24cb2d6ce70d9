"""Search reads each tenant's serving generation (issue 28, services/search/serving.py): the
query is embedded by that generation's model and matched against its chunks; a search that
read the old generation just before a switch committed runs once more with the new one; a
database without generations is searched with the configured embedder, as before."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import asyncpg
import httpx
import pytest
import structlog

from services.app import create_app
from services.embedding.hashing import HashingEmbedder
from services.embedding.port import Embedder, Vectors
from services.embedding.settings import EmbeddingSettings, HashingConfig
from services.index.generations import SearchGeneration
from services.publisher.settings import PublisherSettings
from services.runtime.errors import ConfigError
from services.runtime.indexing.index_failures import ErrorCode, IndexingFailed
from services.runtime.settings import RuntimeSettings
from services.search.connections import open_search_pool
from services.search.searcher import Degraded, SearchMode, SearchRequest
from services.search.serving import GenerationSearch, ServingGenerations, query_embedders
from services.search.statements import SearchSettings
from tests.support.api import BASE_URL, add_tenant
from tests.support.search import (
    STRATEGY,
    ChunkSpec,
    add_document,
    add_version,
    create_ann_index,
    point_search_at,
)

pytestmark = pytest.mark.integration

LARGE = HashingEmbedder(384)  # generation 1: the default profile's model
SMALL = HashingEmbedder(256)  # generation 2: profile "small"
SMALL_PROFILE = {"KB_EMBEDDING_PROFILE_SMALL_PROVIDER": "hashing"}
# What each generation's chunks of a document say: an answer names the generation it read.
LARGE_TEXT = "refunds are paid within 30 days (large model)"
SMALL_TEXT = "refunds are paid within 30 days (small model)"
REFUNDS = {"query": "refunds paid", "principals": ["group:all"]}


@pytest.fixture(autouse=True)
def small_profile(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in SMALL_PROFILE.items():
        monkeypatch.setenv(name, value)


@pytest.fixture
def search_settings(settings: RuntimeSettings) -> SearchSettings:
    return SearchSettings(
        database_url=settings.database_url,
        kafka_bootstrap_servers=settings.kafka_bootstrap_servers,
    )


@pytest.fixture
async def search_pool(search_settings: SearchSettings) -> AsyncIterator[asyncpg.Pool[Any]]:
    pool = await open_search_pool(search_settings)
    try:
        await create_ann_index(pool, LARGE.model, LARGE.dimension)
        await create_ann_index(pool, SMALL.model, SMALL.dimension)
        yield pool
    finally:
        await pool.close()


async def add_generation(
    conn: asyncpg.Connection[Any], profile: str, embedder: HashingEmbedder, *, default: bool
) -> int:
    if default:  # the one default: whatever an indexer start may have registered gives way
        await conn.execute("UPDATE search_generation SET is_default = false")
    generation_id: int = await conn.fetchval(
        "INSERT INTO search_generation (provider_profile, embedding_model, dimension,"
        " chunk_max_tokens, chunk_overlap_tokens, chunking_settings, is_default)"
        " VALUES ($1, $2, $3, 256, 0, $4, $5) RETURNING generation_id",
        profile,
        embedder.model,
        embedder.dimension,
        STRATEGY,
        default,
    )
    return generation_id


async def build_in(
    conn: asyncpg.Connection[Any], tenant_id: str, generation_id: int, *, serving: bool
) -> None:
    await conn.execute(
        "INSERT INTO tenant_search_generation (tenant_id, generation_id, serving)"
        " VALUES ($1, $2, $3)",
        tenant_id,
        generation_id,
        serving,
    )


async def refunds_in_both(
    conn: asyncpg.Connection[Any], tenant_id: str, served_by: HashingEmbedder
) -> uuid.UUID:
    """A document whose version 1 is built in both generations (each chunk saying which),
    its search pointer at ``served_by``'s."""
    document_id = await add_document(conn, tenant_id)
    await add_version(conn, tenant_id, document_id, 1, [ChunkSpec(LARGE_TEXT)], LARGE)
    await conn.execute(
        "INSERT INTO knowledge_chunk (tenant_id, document_id, version_number, embedding_model,"
        " chunk_id, ordinal, heading_path, text, content_digest, embedding_dimension,"
        " embedding, chunking_strategy)"
        " SELECT tenant_id, document_id, version_number, $3, chunk_id, ordinal, heading_path,"
        "        $4, content_digest, $5, $6::text::vector, chunking_strategy"
        "   FROM knowledge_chunk WHERE tenant_id = $1 AND document_id = $2",
        tenant_id,
        document_id,
        SMALL.model,
        SMALL_TEXT,
        SMALL.dimension,
        "[" + ",".join(repr(float(x)) for x in SMALL.embed_sync([SMALL_TEXT])[0]) + "]",
    )
    await point_search_at(conn, tenant_id, document_id, 1, served_by.model)
    return document_id


async def switch(conn: asyncpg.Connection[Any], tenant_id: str, to: int, model: str) -> None:
    """As `kb index generations switch` does: every pointer of the tenant and its serving
    row, in one transaction."""
    async with conn.transaction():
        await conn.execute(
            "UPDATE document_search_version SET embedding_model = $2 WHERE tenant_id = $1",
            tenant_id,
            model,
        )
        await conn.execute(
            "UPDATE tenant_search_generation SET serving = (generation_id = $2)"
            " WHERE tenant_id = $1",
            tenant_id,
            to,
        )


def hybrid(tenant_id: str, principals: Sequence[str] = ("group:all",)) -> SearchRequest:
    return SearchRequest(tenant_id, "refunds paid", tuple(principals))


# --- each tenant reads its own generation ----------------------------------------------------


async def test_each_tenant_is_searched_in_its_serving_generation(
    settings: RuntimeSettings,
    search_settings: SearchSettings,
    search_pool: asyncpg.Pool[Any],
    conn: asyncpg.Connection[Any],
) -> None:
    acme = await add_tenant(conn, "acme")
    globex = await add_tenant(conn, "globex")
    initech = await add_tenant(conn, "initech")
    large = await add_generation(conn, "default", LARGE, default=True)
    small = await add_generation(conn, "small", SMALL, default=False)
    # acme: served by the large generation; globex: built in both, served by the small one;
    # initech: no row, served by the default (large) generation.
    await build_in(conn, "acme", large, serving=True)
    await build_in(conn, "globex", large, serving=False)
    await build_in(conn, "globex", small, serving=True)
    await refunds_in_both(conn, "acme", LARGE)
    await refunds_in_both(conn, "globex", SMALL)
    await refunds_in_both(conn, "initech", LARGE)

    url, kafka = settings.database_url, settings.kafka_bootstrap_servers
    app = create_app(
        PublisherSettings(database_url=url, kafka_bootstrap_servers=kafka),
        search_settings=search_settings,
        embedding_settings=EmbeddingSettings(provider=HashingConfig(dimensions=LARGE.dimension)),
    )
    with structlog.testing.capture_logs() as logs:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url=BASE_URL) as client:
                answers = {}
                for tenant in (acme, globex, initech):
                    for mode in ("hybrid", "vector", "keyword"):
                        response = await client.post(
                            tenant.path("/search"),
                            json={**REFUNDS, "mode": mode},
                            headers=tenant.headers,
                        )
                        assert response.status_code == 200, response.text
                        answers[(tenant.tenant_id, mode)] = response.json()

    for (tenant_id, mode), body in answers.items():
        served = SMALL if tenant_id == "globex" else LARGE
        assert body["generation"] == {
            "embeddingModel": served.model,
            "dimension": served.dimension,
            "generationId": small if served is SMALL else large,
        }, mode
        texts = [r["text"] for r in body["results"]]
        assert texts == [SMALL_TEXT if served is SMALL else LARGE_TEXT], (tenant_id, mode)
    # One searcher per generation, whatever the number of tenants; the default profile's
    # generation of the configured model reuses the configured embedder.
    opened = [e for e in logs if e["event"] == "search.generation_opened"]
    assert sorted(e["generation_id"] for e in opened) == sorted([large, small])
    assert not [e for e in logs if e["event"] == "search.generation_switched"]


async def test_a_database_without_generations_is_searched_with_the_configured_model(
    search_settings: SearchSettings, search_pool: asyncpg.Pool[Any], conn: asyncpg.Connection[Any]
) -> None:
    await add_tenant(conn, "acme")
    await refunds_in_both(conn, "acme", LARGE)
    await conn.execute("DELETE FROM search_generation")  # whatever an indexer start registered
    search = GenerationSearch(
        search_pool, search_settings, LARGE, query_embedders(search_pool, "test")
    )
    try:
        result = await search.search(hybrid("acme"))
    finally:
        await search.aclose()
    assert result.generation.generation_id is None
    assert (result.generation.embedding_model, result.generation.dimension) == (LARGE.model, 384)
    assert [hit.text for hit in result.results] == [LARGE_TEXT]


# --- a switch between reading the generation and searching -----------------------------------


class PausedEmbedder(HashingEmbedder):
    """Embeds as the hashing embedder, after the test let it: the search has read its
    generation and waits here, before its statements run."""

    def __init__(self, dimension: int) -> None:
        super().__init__(dimension)
        self.embedding = asyncio.Event()
        self.go_on = asyncio.Event()
        self.calls = 0

    async def embed(self, texts: Sequence[str]) -> Vectors:
        self.calls += 1
        self.embedding.set()
        await self.go_on.wait()
        return await super().embed(texts)


async def test_a_search_overtaken_by_a_switch_runs_once_more_in_the_new_generation(
    search_settings: SearchSettings, search_pool: asyncpg.Pool[Any], conn: asyncpg.Connection[Any]
) -> None:
    await add_tenant(conn, "acme")
    large = await add_generation(conn, "default", LARGE, default=True)
    small = await add_generation(conn, "small", SMALL, default=False)
    await build_in(conn, "acme", large, serving=True)
    await build_in(conn, "acme", small, serving=False)
    await refunds_in_both(conn, "acme", LARGE)
    configured = PausedEmbedder(LARGE.dimension)
    search = GenerationSearch(
        search_pool, search_settings, configured, query_embedders(search_pool, "test")
    )
    try:
        with structlog.testing.capture_logs() as logs:
            running = asyncio.create_task(search.search(hybrid("acme")))
            await configured.embedding.wait()  # the large generation was read
            await switch(conn, "acme", small, SMALL.model)
            configured.go_on.set()
            result = await running
    finally:
        await search.aclose()

    # Its statements found no pointer of the large model; the small generation answered.
    assert configured.calls == 1
    assert result.generation.generation_id == small
    assert result.generation.embedding_model == SMALL.model
    assert [hit.text for hit in result.results] == [SMALL_TEXT]
    [event] = [e for e in logs if e["event"] == "search.generation_switched"]
    assert (event["generation_id"], event["serving_generation_id"]) == (large, small)


async def test_an_empty_answer_without_a_switch_is_not_searched_again(
    search_settings: SearchSettings, search_pool: asyncpg.Pool[Any], conn: asyncpg.Connection[Any]
) -> None:
    await add_tenant(conn, "acme")
    large = await add_generation(conn, "default", LARGE, default=True)
    await refunds_in_both(conn, "acme", LARGE)
    configured = PausedEmbedder(LARGE.dimension)
    configured.go_on.set()
    search = GenerationSearch(
        search_pool, search_settings, configured, query_embedders(search_pool, "test")
    )
    try:
        with structlog.testing.capture_logs() as logs:
            result = await search.search(hybrid("acme", principals=("group:nobody",)))
    finally:
        await search.aclose()
    assert result.results == ()
    assert result.generation.generation_id == large
    assert configured.calls == 1
    assert not [e for e in logs if e["event"] == "search.generation_switched"]


# --- per generation: degraded answers, profiles this process lacks ----------------------------


class DownEmbedder(HashingEmbedder):
    closed = False

    async def embed(self, texts: Sequence[str]) -> Vectors:
        raise IndexingFailed(ErrorCode.EMBEDDING_UNAVAILABLE, "provider down")

    async def aclose(self) -> None:
        self.closed = True


async def test_hybrid_degrades_to_keywords_in_the_tenant_s_generation(
    search_settings: SearchSettings, search_pool: asyncpg.Pool[Any], conn: asyncpg.Connection[Any]
) -> None:
    await add_tenant(conn, "acme")
    await add_generation(conn, "default", LARGE, default=True)
    small = await add_generation(conn, "small", SMALL, default=False)
    await build_in(conn, "acme", small, serving=True)
    await refunds_in_both(conn, "acme", SMALL)
    built: list[tuple[SearchGeneration, DownEmbedder]] = []

    def down(generation: SearchGeneration) -> Embedder:
        built.append((generation, DownEmbedder(generation.dimension)))
        return built[-1][1]

    configured = DownEmbedder(LARGE.dimension)
    search = GenerationSearch(search_pool, search_settings, configured, down)
    try:
        degraded = await search.search(hybrid("acme"))
        keyword = await search.search(
            SearchRequest("acme", "refunds paid", ("group:all",), mode=SearchMode.KEYWORD)
        )
    finally:
        await search.aclose()
    assert [g.generation_id for g, _ in built] == [small]  # opened once, for both searches
    # Closed with the search; the configured embedder is its owner's to close.
    assert [embedder.closed for _, embedder in built] == [True]
    assert not configured.closed
    assert degraded.degraded is Degraded.KEYWORD_ONLY
    for result in (degraded, keyword):
        assert result.generation.generation_id == small
        assert [hit.text for hit in result.results] == [SMALL_TEXT]


async def test_a_generation_whose_profile_this_process_lacks_fails_its_searches_only(
    search_settings: SearchSettings, search_pool: asyncpg.Pool[Any], conn: asyncpg.Connection[Any]
) -> None:
    for tenant_id in ("acme", "globex"):
        await add_tenant(conn, tenant_id)
        await refunds_in_both(conn, tenant_id, LARGE)
    await add_generation(conn, "default", LARGE, default=True)
    elsewhere = await add_generation(conn, "elsewhere", SMALL, default=False)
    await build_in(conn, "globex", elsewhere, serving=True)
    search = GenerationSearch(
        search_pool, search_settings, LARGE, query_embedders(search_pool, "test")
    )
    try:
        with structlog.testing.capture_logs() as logs:
            for _ in range(2):
                with pytest.raises(ConfigError, match="elsewhere"):
                    await search.search(hybrid("globex"))
        assert [hit.text for hit in (await search.search(hybrid("acme"))).results] == [LARGE_TEXT]
    finally:
        await search.aclose()
    # Logged once: the second search is answered from what the first found.
    assert len([e for e in logs if e["event"] == "search.generation_unusable"]) == 1


async def test_the_serving_generation_is_the_tenant_s_serving_row_else_the_default(
    search_settings: SearchSettings, search_pool: asyncpg.Pool[Any], conn: asyncpg.Connection[Any]
) -> None:
    await add_tenant(conn, "acme")
    await add_tenant(conn, "globex")
    large = await add_generation(conn, "default", LARGE, default=True)
    small = await add_generation(conn, "small", SMALL, default=False)
    await build_in(conn, "globex", small, serving=True)
    serving = ServingGenerations(search_pool, search_settings)
    acme = await serving.serving("acme")
    globex = await serving.serving("globex")
    assert acme is not None
    assert (acme.generation_id, acme.is_default) == (large, True)
    assert globex is not None
    assert (globex.generation_id, globex.embedding_model) == (small, SMALL.model)
    await conn.execute("DELETE FROM tenant_search_generation")
    await conn.execute("DELETE FROM search_generation")
    assert await serving.serving("globex") is None
