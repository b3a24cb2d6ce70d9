"""POST /v1/tenants/{t}/search over a real PostgreSQL: what it finds, and the walls it keeps
(tenant, READ ACL, current search version) in every mode."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from services.publisher.domain import check_principals
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

MODES = ["hybrid", "vector", "keyword"]
REFUND = [
    ChunkSpec("Refunds are possible within 30 days of purchase.", ("Refund policy", "Window")),
    ChunkSpec("Shipping costs are not refunded.", ("Refund policy", "Exceptions")),
    ChunkSpec("Contact support by email to start a refund.", ("Contact",)),
]


# Every test on both paths of the vector list: walking the tenant partition's HNSW index,
# and ranking every readable chunk exactly.
@pytest.fixture(params=[VectorPath.ANN, VectorPath.EXACT], ids=["ann", "exact"])
async def api(
    settings: RuntimeSettings, request: pytest.FixtureRequest
) -> AsyncIterator[SearchHarness]:
    async with search_harness(settings, vector_path=request.param) as harness:
        await create_ann_index(harness.pool, harness.embedder.model, harness.embedder.dimension)
        yield harness


@pytest.fixture
async def acme(conn: asyncpg.Connection[Any]) -> ApiTenant:
    return await add_tenant(conn, "acme", "standard")


@pytest.fixture
async def globex(conn: asyncpg.Connection[Any]) -> ApiTenant:
    return await add_tenant(conn, "globex", "premium")


async def searchable(
    conn: asyncpg.Connection[Any],
    api: SearchHarness,
    tenant: ApiTenant,
    chunks: list[ChunkSpec] = REFUND,
    *,
    read: tuple[str, ...] = ("group:all",),
    title: str = "Refund policy",
) -> uuid.UUID:
    document_id = await add_document(conn, tenant.tenant_id, title=title, read=read)
    await add_version(conn, tenant.tenant_id, document_id, 1, chunks, api.embedder)
    await point_search_at(conn, tenant.tenant_id, document_id, 1, api.embedder.model)
    return document_id


def _problem(response: Any, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    body: dict[str, Any] = response.json()
    assert body["errorCode"] == code, body
    return body


@pytest.mark.parametrize("mode", MODES)
async def test_finds_the_matching_chunk_with_its_document(
    api: SearchHarness, acme: ApiTenant, conn: asyncpg.Connection[Any], mode: str
) -> None:
    document_id = await searchable(conn, api, acme)

    response = await api.search(
        acme, {"query": "shipping refunded", "principals": ["group:all"], "mode": mode, "topK": 2}
    )

    assert response.status_code == 200, response.text
    body = response.json()
    assert set(body) == {"results", "generation", "tookMs", "degraded"}
    assert body["degraded"] is None  # the provider answered: nothing was left out
    assert body["generation"] == {
        "embeddingModel": "hashing-v1-64",
        "dimension": 64,
        "generationId": None,
    }
    assert body["tookMs"] >= 0
    top = body["results"][0]
    assert top["documentId"] == str(document_id)
    assert top["title"] == "Refund policy"
    assert top["versionNumber"] == 1
    # The stored upload's media type (issue 45: a retriever's metadata names it).
    assert top["mediaType"] == "text/plain"
    assert top["headingPath"] == ["Refund policy", "Exceptions"]
    assert top["text"] == "Shipping costs are not refunded."
    assert isinstance(top["chunkId"], str)
    assert isinstance(top["score"], float)
    assert 1 <= len(body["results"]) <= 2
    scores = [r["score"] for r in body["results"]]
    assert scores == sorted(scores, reverse=True)


async def test_keyword_search_matches_headings(
    api: SearchHarness, acme: ApiTenant, conn: asyncpg.Connection[Any]
) -> None:
    await searchable(conn, api, acme)
    body = (
        await api.search(acme, {"query": "contact", "principals": ["group:all"], "mode": "keyword"})
    ).json()
    assert [r["headingPath"] for r in body["results"]] == [["Contact"]]


@pytest.mark.parametrize("mode", MODES)
async def test_no_tenant_reads_another_tenants_chunks(
    api: SearchHarness,
    acme: ApiTenant,
    globex: ApiTenant,
    conn: asyncpg.Connection[Any],
    mode: str,
) -> None:
    await searchable(conn, api, globex, title="Globex refunds")
    mine = await searchable(conn, api, acme, title="Acme refunds")

    body = (
        await api.search(
            acme, {"query": "refund", "principals": ["group:all"], "mode": mode, "topK": 100}
        )
    ).json()

    assert body["results"]
    assert {r["documentId"] for r in body["results"]} == {str(mine)}
    assert {r["title"] for r in body["results"]} == {"Acme refunds"}


@pytest.mark.parametrize("mode", MODES)
async def test_another_tenants_acl_for_the_same_document_id_grants_nothing(
    api: SearchHarness,
    acme: ApiTenant,
    globex: ApiTenant,
    conn: asyncpg.Connection[Any],
    mode: str,
) -> None:
    # Document ids are unique per tenant only: globex's ACL row for the same id must not
    # open acme's document (nor its pointer stand for acme's).
    # Each hit's media type is its own tenant's version's, once per chunk: never the
    # other tenant's version of the same id beside it.
    shared = uuid.uuid4()
    for tenant, read, title, media_type in (
        (globex, ("group:x",), "Globex refunds", "text/html"),
        (acme, ("group:y",), "Acme refunds", "text/markdown"),
    ):
        await add_document(conn, tenant.tenant_id, title=title, read=read, document_id=shared)
        await add_version(
            conn, tenant.tenant_id, shared, 1, REFUND, api.embedder, media_type=media_type
        )
        await point_search_at(conn, tenant.tenant_id, shared, 1, api.embedder.model)

    async def found(tenant: ApiTenant, principal: str) -> list[tuple[str, str, str]]:
        body = (
            await api.search(
                tenant, {"query": "refund", "principals": [principal], "mode": mode, "topK": 100}
            )
        ).json()
        return [(r["title"], r["mediaType"], r["chunkId"]) for r in body["results"]]

    def titles(hits: list[tuple[str, str, str]]) -> set[tuple[str, str]]:
        assert len({chunk for _, _, chunk in hits}) == len(hits)
        return {(title, media_type) for title, media_type, _ in hits}

    assert titles(await found(acme, "group:x")) == set()
    assert titles(await found(globex, "group:y")) == set()
    assert titles(await found(acme, "group:y")) == {("Acme refunds", "text/markdown")}
    assert titles(await found(globex, "group:x")) == {("Globex refunds", "text/html")}


ACL_PRINCIPAL = "group:Admins"
NOT_THE_PRINCIPAL = [
    "group:admins",  # case
    "GROUP:ADMINS",
    "group:\u0410dmins",  # Cyrillic capital A
    "group:Adm\u0456ns",  # Cyrillic i
    "group:%",
    "%",
    "_",
    "group:_dmins",
    "\\",
    "{}",
    "{group:Admins}",
    "' OR 1=1 --",
    "group:Admins' OR '1'='1",
    '"group:Admins"',
    "*",
]


@pytest.mark.parametrize("mode", MODES)
async def test_only_principals_named_in_the_read_acl_find_a_document(
    api: SearchHarness, acme: ApiTenant, conn: asyncpg.Connection[Any], mode: str
) -> None:
    await searchable(conn, api, acme, read=(ACL_PRINCIPAL,))

    async def found(principals: list[str]) -> int:
        response = await api.search(
            acme, {"query": "refund", "principals": principals, "mode": mode, "topK": 100}
        )
        assert response.status_code == 200, response.text
        return len(response.json()["results"])

    assert await found([ACL_PRINCIPAL]) == 3
    assert await found(["user:someone", ACL_PRINCIPAL]) == 3
    # Surrounding whitespace is no part of a principal: publish trims it too.
    assert await found([f" {ACL_PRINCIPAL}\t"]) == 3
    for principal in NOT_THE_PRINCIPAL:
        assert await found([principal]) == 0, principal
    assert await found(NOT_THE_PRINCIPAL) == 0
    assert await found([]) == 0


@pytest.mark.parametrize("mode", MODES)
async def test_principals_are_compared_in_the_form_publish_stores(
    api: SearchHarness, acme: ApiTenant, conn: asyncpg.Connection[Any], mode: str
) -> None:
    # Publish stores "group:café" in NFC (precomposed é) and trimmed; a search spelling it
    # with a combining accent and stray spaces names the same principal.
    composed = "group:caf\u00e9"
    decomposed = " group:cafe\u0301 "
    assert composed != decomposed.strip()
    assert check_principals([decomposed]) == frozenset({composed})
    await searchable(conn, api, acme, read=(composed,))
    response = await api.search(
        acme, {"query": "refund", "principals": [decomposed], "mode": mode, "topK": 100}
    )
    assert response.status_code == 200, response.text
    assert len(response.json()["results"]) == 3


@pytest.mark.parametrize("mode", MODES)
async def test_metacharacter_principals_match_only_themselves(
    api: SearchHarness, acme: ApiTenant, conn: asyncpg.Connection[Any], mode: str
) -> None:
    percent = await searchable(conn, api, acme, read=("%",), title="Percent")
    braces = await searchable(conn, api, acme, read=("{}",), title="Braces")
    await searchable(conn, api, acme, read=("group:all",), title="All")

    async def documents(principals: list[str]) -> set[str]:
        response = await api.search(
            acme, {"query": "refund", "principals": principals, "mode": mode, "topK": 100}
        )
        assert response.status_code == 200, response.text
        return {r["documentId"] for r in response.json()["results"]}

    assert await documents(["%"]) == {str(percent)}
    assert await documents(["{}"]) == {str(braces)}
    assert await documents(["_"]) == set()
    assert await documents(["' OR 1=1 --"]) == set()


async def test_empty_principals_find_nothing(
    api: SearchHarness, acme: ApiTenant, conn: asyncpg.Connection[Any]
) -> None:
    await searchable(conn, api, acme)
    for mode in MODES:
        response = await api.search(acme, {"query": "refund", "principals": [], "mode": mode})
        assert response.status_code == 200, response.text
        assert response.json()["results"] == []


async def test_filters_narrow_to_documents_and_heading_prefixes(
    api: SearchHarness, acme: ApiTenant, conn: asyncpg.Connection[Any]
) -> None:
    first = await searchable(conn, api, acme, title="First")
    second = await searchable(conn, api, acme, title="Second")
    base = {"query": "refund support shipping", "principals": ["group:all"], "topK": 100}

    only_second = (
        await api.search(acme, {**base, "filter": {"documentIds": [str(second)]}})
    ).json()
    assert {r["documentId"] for r in only_second["results"]} == {str(second)}

    refund_policy = (
        await api.search(acme, {**base, "filter": {"headingPrefix": ["Refund policy"]}})
    ).json()
    assert {tuple(r["headingPath"][:1]) for r in refund_policy["results"]} == {("Refund policy",)}
    assert len(refund_policy["results"]) == 4

    window = (
        await api.search(
            acme,
            {
                **base,
                "filter": {
                    "headingPrefix": ["Refund policy", "Window"],
                    "documentIds": [str(first)],
                },
            },
        )
    ).json()
    assert [(r["documentId"], r["headingPath"]) for r in window["results"]] == [
        (str(first), ["Refund policy", "Window"])
    ]

    nothing = (await api.search(acme, {**base, "filter": {"documentIds": []}})).json()
    assert nothing["results"] == []


@pytest.mark.parametrize("mode", MODES)
async def test_only_the_current_search_version_is_searched(
    api: SearchHarness, acme: ApiTenant, conn: asyncpg.Connection[Any], mode: str
) -> None:
    document_id = await add_document(conn, "acme")
    await add_version(
        conn, "acme", document_id, 1, [ChunkSpec("refund within 30 days")], api.embedder
    )
    await add_version(
        conn, "acme", document_id, 2, [ChunkSpec("refund within 60 days")], api.embedder
    )
    body = {"query": "refund within days", "principals": ["group:all"], "mode": mode}

    # Chunks written, no pointer yet: nothing is searchable.
    assert (await api.search(acme, body)).json()["results"] == []

    await point_search_at(conn, "acme", document_id, 1, api.embedder.model)
    assert [r["text"] for r in (await api.search(acme, body)).json()["results"]] == [
        "refund within 30 days"
    ]

    await point_search_at(conn, "acme", document_id, 2, api.embedder.model)
    assert [r["text"] for r in (await api.search(acme, body)).json()["results"]] == [
        "refund within 60 days"
    ]


async def test_a_failed_version_leaves_the_previous_one_served(
    api: SearchHarness, acme: ApiTenant, conn: asyncpg.Connection[Any]
) -> None:
    document_id = await add_document(conn, "acme")
    for version in (1, 2, 3):
        await add_version(
            conn, "acme", document_id, version, [ChunkSpec(f"refund rule {version}")], api.embedder
        )
    await point_search_at(conn, "acme", document_id, 2, api.embedder.model)
    # v3 failed for good: its task is DEAD and the pointer stays at v2, even with v3's chunks
    # present (they never are after a failure; a stray row must still not be served).
    await conn.execute(
        "INSERT INTO index_task (task_id, tenant_id, document_id, version_number, tier, status,"
        " error_code, finished_at) VALUES ($1, 'acme', $2, 3, 'standard', 'DEAD',"
        " 'DOCUMENT_PARSE_FAILED', now())",
        uuid.uuid4(),
        document_id,
    )
    for mode in MODES:
        results = (
            await api.search(
                acme, {"query": "refund rule", "principals": ["group:all"], "mode": mode}
            )
        ).json()["results"]
        assert [(r["versionNumber"], r["text"]) for r in results] == [(2, "refund rule 2")], mode


async def test_chunks_of_another_model_or_strategy_are_not_served(
    api: SearchHarness, acme: ApiTenant, conn: asyncpg.Connection[Any]
) -> None:
    document_id = await add_document(conn, "acme")
    await add_version(conn, "acme", document_id, 1, [ChunkSpec("refund policy")], api.embedder)
    for mode in MODES:
        body = {"query": "refund policy", "principals": ["group:all"], "mode": mode}
        await point_search_at(conn, "acme", document_id, 1, "another-model")
        assert (await api.search(acme, body)).json()["results"] == [], mode
        await point_search_at(conn, "acme", document_id, 1, api.embedder.model, strategy="other")
        assert (await api.search(acme, body)).json()["results"] == [], mode


@pytest.mark.parametrize("mode", MODES)
async def test_nothing_to_search_is_an_empty_answer(
    api: SearchHarness, acme: ApiTenant, globex: ApiTenant, conn: asyncpg.Connection[Any], mode: str
) -> None:
    body = {"query": "refund", "principals": ["group:all"], "mode": mode}
    # An empty index.
    response = await api.search(acme, body)
    assert response.status_code == 200, response.text
    assert response.json()["results"] == []
    # Another tenant has documents; this one has none.
    await searchable(conn, api, globex)
    response = await api.search(acme, body)
    assert response.status_code == 200, response.text
    assert response.json()["results"] == []


async def test_stop_words_and_punctuation_only_find_nothing_by_keyword(
    api: SearchHarness, acme: ApiTenant, globex: ApiTenant, conn: asyncpg.Connection[Any]
) -> None:
    await conn.execute("UPDATE tenant SET text_search_config = 'english' WHERE tenant_id = 'acme'")
    await searchable(conn, api, acme, [ChunkSpec("The refund is the best of all.")])
    await searchable(conn, api, globex, [ChunkSpec("The refund is the best of all.")])

    async def answer(tenant: ApiTenant, query: str, mode: str) -> list[Any]:
        response = await api.search(
            tenant, {"query": query, "principals": ["group:all"], "mode": mode}
        )
        assert response.status_code == 200, response.text
        results: list[Any] = response.json()["results"]
        return results

    assert await answer(acme, "the of is", "keyword") == []
    assert await answer(acme, "!!! ??? --", "keyword") == []
    assert await answer(globex, "!!! ??? --", "keyword") == []
    assert await answer(globex, '"" OR -', "keyword") == []
    # The english configuration stems: "refunds" finds "refund"; simple does not.
    assert len(await answer(acme, "refunds", "keyword")) == 1
    assert await answer(globex, "refunds", "keyword") == []
    assert len(await answer(globex, "refund", "keyword")) == 1
    # Hybrid still answers from the vector side.
    for tenant in (acme, globex):
        for query in ("the of is", "!!! ???"):
            assert len(await answer(tenant, query, "hybrid")) == 1


async def test_a_selective_acl_still_fills_top_k(
    api: SearchHarness, acme: ApiTenant, conn: asyncpg.Connection[Any]
) -> None:
    # 200 documents of 10 chunks; the caller may read 3 of them (1.5%). A plain HNSW scan
    # with ef_search 100 would see about one readable chunk; the iterative scan goes on.
    texts = [f"policy clause {n} about refunds and returns" for n in range(10)]
    readable = set()
    for n in range(200):
        principal = "group:few" if n % 67 == 0 else "group:many"
        document_id = await add_document(conn, "acme", title=f"Doc {n}", read=(principal,))
        await add_version(conn, "acme", document_id, 1, [ChunkSpec(t) for t in texts], api.embedder)
        await point_search_at(conn, "acme", document_id, 1, api.embedder.model)
        if principal == "group:few":
            readable.add(str(document_id))
    await conn.execute("ANALYZE")
    assert len(readable) == 3
    for mode in MODES:
        results = (
            await api.search(
                acme,
                {"query": "refunds policy", "principals": ["group:few"], "mode": mode, "topK": 25},
            )
        ).json()["results"]
        assert len(results) == 25, mode
        assert {r["documentId"] for r in results} <= readable


# --- bad input and auth ----------------------------------------------------------------------

VALID = {"query": "refund", "principals": ["group:all"]}
BAD_BODIES = [
    {**VALID, "query": ""},
    {**VALID, "query": "   \n\t"},
    {**VALID, "query": "x" * 1001},
    {**VALID, "query": "refund\x00"},
    {**VALID, "query": 42},
    {"principals": ["group:all"]},
    {"query": "refund"},
    {**VALID, "principals": "group:all"},
    {**VALID, "principals": [""]},
    {**VALID, "principals": ["p" * 201]},
    {**VALID, "principals": ["group\x00all"]},
    {**VALID, "principals": [f"user:{n}" for n in range(1001)]},
    {**VALID, "topK": 0},
    {**VALID, "topK": 101},
    {**VALID, "topK": -1},
    {**VALID, "topK": "10"},
    {**VALID, "topK": 1.5},
    {**VALID, "topK": True},
    {**VALID, "mode": "fuzzy"},
    {**VALID, "mode": "HYBRID"},
    {**VALID, "filter": {"documentIds": ["not-a-uuid"]}},
    {**VALID, "filter": {"headingPrefix": []}},
    {**VALID, "filter": {"headingPrefix": [""]}},
    {**VALID, "filter": {"tenant": "globex"}},
    {**VALID, "tenantId": "globex"},
]


@pytest.mark.parametrize("body", BAD_BODIES, ids=range(len(BAD_BODIES)))
async def test_bad_input_is_422_problem(
    api: SearchHarness, acme: ApiTenant, body: dict[str, Any]
) -> None:
    body_ = _problem(await api.search(acme, body), 422, "VALIDATION_FAILED")
    assert body_["errors"]


async def test_malformed_json_is_400(api: SearchHarness, acme: ApiTenant) -> None:
    response = await api.client.post(
        acme.path("/search"),
        content=b"{not json",
        headers={**acme.headers, "content-type": "application/json"},
    )
    _problem(response, 400, "MALFORMED_JSON")


async def test_limits_are_inclusive(api: SearchHarness, acme: ApiTenant) -> None:
    for body in (
        {**VALID, "query": "x" * 1000, "topK": 100},
        {**VALID, "topK": 1, "principals": [f"user:{n}" for n in range(1000)]},
    ):
        response = await api.search(acme, body)
        assert response.status_code == 200, response.text


async def test_search_needs_the_tenants_own_key(
    api: SearchHarness, acme: ApiTenant, globex: ApiTenant, conn: asyncpg.Connection[Any]
) -> None:
    await searchable(conn, api, acme)
    path = acme.path("/search")
    missing = await api.client.post(path, json=VALID)
    _problem(missing, 401, "UNAUTHENTICATED")
    assert missing.headers["www-authenticate"] == "Bearer"
    wrong = await api.client.post(
        path, json=VALID, headers={"Authorization": "Bearer kb.acme.nope"}
    )
    _problem(wrong, 401, "UNAUTHENTICATED")
    other = await api.client.post(path, json=VALID, headers=globex.headers)
    _problem(other, 403, "FORBIDDEN")
    # Auth comes before validation: a bad body without a key is still 401.
    _problem(await api.client.post(path, json={"query": ""}), 401, "UNAUTHENTICATED")
    _problem(await api.client.post("/v1/tenants/nobody/search", json=VALID), 401, "UNAUTHENTICATED")
