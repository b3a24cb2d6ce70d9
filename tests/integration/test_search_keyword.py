"""The keyword list over a real PostgreSQL: its candidate cap bounds what is ranked but never
what the walls keep out, natural questions match any of their words, the user's syntax
still means what it says, and common words do not choose the candidates."""

from __future__ import annotations

import json
import uuid
from typing import Any

import asyncpg
import pytest

from services.embedding.hashing import HashingEmbedder
from services.search.index_pg import PgSearchIndex, read_word_sample
from services.search.keyword_terms import (
    KeywordTerms,
    QueryWords,
    keyword_terms,
)
from services.search.searcher import Generation, SearchMode, SearchRequest
from services.search.statements import (
    ALL_KEYWORD_KINDS,
    QUERIES,
    KeywordKinds,
    SearchSettings,
    VectorPath,
)
from tests.support.search import ChunkSpec, add_document, add_version, point_search_at

pytestmark = pytest.mark.integration

EMBEDDER = HashingEmbedder(64)
CAP = 10


@pytest.fixture
async def conn_with_tenants(conn: asyncpg.Connection[Any]) -> asyncpg.Connection[Any]:
    await conn.execute(
        "INSERT INTO tenant (tenant_id, tier) VALUES ('acme', 'standard'), ('globex', 'standard')"
    )
    return conn


@pytest.fixture
def index(pool: asyncpg.Pool[Any]) -> PgSearchIndex:
    return index_with(pool, CAP)


SETTINGS = SearchSettings(database_url="postgresql://unused/db", search_keyword_candidates=CAP)


def index_with(pool: asyncpg.Pool[Any], cap: int) -> PgSearchIndex:
    settings = SETTINGS.model_copy(update={"search_keyword_candidates": cap})
    return PgSearchIndex(pool, Generation(EMBEDDER.model, EMBEDDER.dimension), settings)


# Documents whose chunks a scan reaches last, whichever way it goes: last in the table, and
# last in document id order (the primary key's and the ACL index's).
LAST = uuid.UUID(int=2**128 - 1)


async def searchable(
    conn: asyncpg.Connection[Any],
    chunks: list[ChunkSpec],
    *,
    tenant: str = "acme",
    read: tuple[str, ...] = ("group:all",),
    title: str = "Doc",
    document_id: uuid.UUID | None = None,
) -> list[str]:
    document_id = await add_document(conn, tenant, title=title, read=read, document_id=document_id)
    ids = await add_version(conn, tenant, document_id, 1, chunks, EMBEDDER)
    await point_search_at(conn, tenant, document_id, 1, EMBEDDER.model)
    return ids


async def keyword(
    index: PgSearchIndex,
    query: str,
    *,
    principals: tuple[str, ...] = ("group:all",),
    top_k: int = 10,
) -> list[str]:
    request = SearchRequest("acme", query, principals, top_k=top_k, mode=SearchMode.KEYWORD)
    candidates = await index.candidates(request, None)
    return [c.text for c in sorted(candidates.keyword, key=lambda c: c.rank)]


async def test_the_cap_bounds_how_many_matches_are_ranked(
    conn_with_tenants: asyncpg.Connection[Any], pool: asyncpg.Pool[Any], index: PgSearchIndex
) -> None:
    conn = conn_with_tenants
    # 3 * CAP chunks say "refund" once; the best match comes last in the table, where a scan
    # reaches it only after the first CAP matches.
    await searchable(conn, [ChunkSpec(f"refund clause {n}") for n in range(3 * CAP)])
    best = [ChunkSpec("refund refund refund", ("Refund",))]
    await searchable(conn, best, title="Best", document_id=LAST)

    capped = await keyword(index, "refund", top_k=5)
    assert len(capped) == 5
    assert all(text.startswith("refund clause") for text in capped)

    uncapped = index_with(pool, 1000)
    assert (await keyword(uncapped, "refund", top_k=5))[0] == "refund refund refund"


async def test_the_walls_apply_before_the_cap(
    conn_with_tenants: asyncpg.Connection[Any], index: PgSearchIndex
) -> None:
    conn = conn_with_tenants
    decoys = [ChunkSpec(f"refund clause {n}") for n in range(3 * CAP)]
    # Before the caller's chunks in the table: another tenant's, another principal's, and
    # a version no search pointer names.
    await searchable(conn, decoys, tenant="globex")
    await searchable(conn, decoys, read=("group:other",))
    stale = await add_document(conn, "acme", read=("group:mine",))
    await add_version(conn, "acme", stale, 1, decoys, EMBEDDER)
    await add_version(
        conn, "acme", stale, 2, [ChunkSpec("refund in the current version")], EMBEDDER
    )
    await point_search_at(conn, "acme", stale, 2, EMBEDDER.model)
    await searchable(
        conn, [ChunkSpec(f"refund for me {n}") for n in range(3)], read=("group:mine",)
    )

    found = await keyword(index, "refund", principals=("group:mine",), top_k=CAP)
    assert sorted(found) == [
        "refund for me 0",
        "refund for me 1",
        "refund for me 2",
        "refund in the current version",
    ]


async def test_a_natural_question_finds_chunks_holding_some_of_its_words(
    conn_with_tenants: asyncpg.Connection[Any], index: PgSearchIndex
) -> None:
    await searchable(
        conn_with_tenants,
        [
            ChunkSpec("Shipping costs are not refunded.", ("Refund policy",)),
            ChunkSpec("Contact support by email.", ("Contact",)),
            ChunkSpec("Opening hours are nine to five."),
        ],
    )
    # No chunk holds every word ('simple' keeps "how", "do", "I"): all words ANDed found
    # nothing; any of them, ranked by the rarer ones a chunk holds, finds the answer first.
    found = await keyword(index, "how do I get my shipping costs refunded")
    assert found[0] == "Shipping costs are not refunded."
    assert "Contact support by email." not in found


async def test_the_users_syntax_still_means_what_it_says(
    conn_with_tenants: asyncpg.Connection[Any], index: PgSearchIndex
) -> None:
    await searchable(
        conn_with_tenants,
        [
            ChunkSpec("Refunds within 30 days of purchase."),
            ChunkSpec("Days off: 30 per year, refunds not applicable."),
            ChunkSpec("Shipping costs are not refunded."),
            ChunkSpec("Contact support by email."),
        ],
    )
    # A quoted phrase: the words next to each other, in that order.
    assert await keyword(index, '"30 days"') == ["Refunds within 30 days of purchase."]
    # -word: none holding it; no falling back to "any of the words".
    assert await keyword(index, "refunds -days") == []
    assert await keyword(index, "30 -purchase") == [
        "Days off: 30 per year, refunds not applicable."
    ]
    # or: either side.
    assert sorted(await keyword(index, "shipping or email")) == [
        "Contact support by email.",
        "Shipping costs are not refunded.",
    ]


async def test_common_words_do_not_choose_the_candidates(
    conn_with_tenants: asyncpg.Connection[Any], index: PgSearchIndex
) -> None:
    conn = conn_with_tenants
    # "policy" is in 4 * CAP chunks, the telling word in one, last in the table. Only
    # the statistics say which is which.
    await searchable(conn, [ChunkSpec(f"general policy clause {n}") for n in range(4 * CAP)])
    telling = [ChunkSpec("policy on refunds for damaged goods")]
    await searchable(conn, telling, title="Refunds", document_id=LAST)

    # No chunk holds "details": the rarer words choose the candidates, then the rarest
    # common one fills the list; a chunk holding both ranks first.
    found = await keyword(index, "refunds policy details")
    assert found[0] == "policy on refunds for damaged goods"
    assert len(found) == 10


async def test_the_rarest_common_word_only_fills_the_list_to_its_depth(
    conn_with_tenants: asyncpg.Connection[Any], index: PgSearchIndex
) -> None:
    # Its matches are tested chunk by chunk (it is in more than CAP chunks): taking CAP of
    # them to rank would test every readable chunk; the list needs only what fills it.
    conn = conn_with_tenants
    await searchable(conn, [ChunkSpec(f"general policy clause {n}") for n in range(4 * CAP)])
    await searchable(conn, [ChunkSpec("policy on refunds for damaged goods")], title="Refunds")
    depth = 3
    request = SearchRequest(
        "acme", "refunds policy details", ("group:all",), top_k=depth, mode=SearchMode.KEYWORD
    )
    terms, plan = await keyword_plan(conn, index, request, analyze=True)
    assert terms.any_word is not None
    assert terms.rarest_word == "'policy'"
    candidates = [
        node["Actual Rows"]
        for node in walk(plan)
        if node.get("Subplan Name") == "CTE keyword_candidate"
    ]
    assert candidates == [depth]  # 1 holding "refunds", 2 holding "policy" (not 1 + CAP)
    found = await keyword(index, request.query, top_k=depth)
    assert found[0] == "policy on refunds for damaged goods"
    assert len(found) == depth


async def keyword_plan(
    conn: asyncpg.Connection[Any],
    index: PgSearchIndex,
    request: SearchRequest,
    *,
    analyze: bool = False,
    path: VectorPath = VectorPath.EXACT,
    kinds: KeywordKinds | None = None,
) -> tuple[KeywordTerms, dict[str, Any]]:
    """The request's keyword terms and the plan of the keyword statement a search runs for
    them on ``path`` (``kinds``: that variant's instead), read as a search reads them:
    keyword_terms first, in the same transaction."""
    terms, plan = await _keyword_statement(conn, index, request, "EXPLAIN", analyze, path, kinds)
    return terms, json.loads(plan)[0]["Plan"]


async def keyword_rows(
    conn: asyncpg.Connection[Any],
    index: PgSearchIndex,
    request: SearchRequest,
    path: VectorPath,
    kinds: KeywordKinds,
) -> list[tuple[Any, ...]]:
    _, rows = await _keyword_statement(conn, index, request, "", False, path, kinds)
    return [tuple(row) for row in rows]


async def _keyword_statement(
    conn: asyncpg.Connection[Any],
    index: PgSearchIndex,
    request: SearchRequest,
    explain: str,
    analyze: bool,
    path: VectorPath,
    kinds: KeywordKinds | None,
) -> tuple[KeywordTerms, Any]:
    sample = await read_word_sample(conn, request.tenant_id, EMBEDDER.model, SETTINGS)
    common = sample.common_lexemes()
    async with conn.transaction(readonly=True, isolation="repeatable_read"):
        row = await conn.fetchrow(QUERIES["keyword_terms"], request.tenant_id, request.query)
        assert row is not None
        words = QueryWords(
            row["strict"], row["natural"], tuple(row["lexemes"]), tuple(row["queries"])
        )
        terms = keyword_terms(words, common, CAP)
        if kinds is None:
            kinds = KeywordKinds.of(terms.any_word, terms.rarest_word)
        statement = index.keyword_statement(path, kinds)
        if explain:
            options = "ANALYZE, FORMAT JSON" if analyze else "FORMAT JSON"
            statement = f"{explain} ({options}) {statement}"
        args = (request.tenant_id, list(request.principals), None, None, request.depth)
        result = await conn.fetch(statement, *args, *terms.parameters(), CAP)
    return terms, (result[0][0] if explain else result)


def walk(node: dict[str, Any]) -> list[dict[str, Any]]:
    return [node, *(n for child in node.get("Plans", []) for n in walk(child))]


async def test_the_keyword_list_is_planned_without_hash_or_merge_joins(
    conn_with_tenants: asyncpg.Connection[Any], index: PgSearchIndex
) -> None:
    # A principal who may read a quarter of many documents: the planner, taking the readable
    # documents for far fewer than they are, would hash them with every pointer of the
    # tenant and test each readable chunk's words. keyword_terms turns hash and merge joins
    # off for the rest of the search's transaction, as the vector list's paths do.
    conn = conn_with_tenants
    for n in range(200):
        read = ("group:all", "group:quarter") if n % 4 == 0 else ("group:all",)
        text = "refunds for damaged goods" if n % 50 == 0 else f"general clause {n}"
        await searchable(conn, [ChunkSpec(f"{text} part {c}") for c in range(5)], read=read)
    await conn.execute("VACUUM ANALYZE")
    request = SearchRequest(
        "acme", "damaged refunds", ("group:quarter",), top_k=10, mode=SearchMode.KEYWORD
    )
    _, plan = await keyword_plan(conn, index, request, kinds=ALL_KEYWORD_KINDS)
    nodes = {node["Node Type"] for node in walk(plan)}
    assert not {"Hash Join", "Merge Join"} & nodes
    # Only for that transaction.
    assert await conn.fetchval("SHOW enable_hashjoin") == "on"
    assert await conn.fetchval("SHOW enable_mergejoin") == "on"
    # Documents 0 and 100 hold the words and are readable (50 and 150 are not).
    found = await keyword(index, request.query, principals=("group:quarter",))
    assert sorted(found) == sorted([f"refunds for damaged goods part {c}" for c in range(5)] * 2)


@pytest.mark.parametrize("path", list(VectorPath), ids=lambda p: str(p.value))
async def test_a_query_without_rarer_or_common_words_leaves_out_those_kinds_scans(
    conn_with_tenants: asyncpg.Connection[Any], index: PgSearchIndex, path: VectorPath
) -> None:
    # The keyword list is planned for every search; a kind of candidates the query has no
    # term for would find nothing, and the statement a search runs leaves its scan out
    # (statements.slot_choices; tests/unit/search/snapshots: which text) -- with the full
    # statement's rows.
    conn = conn_with_tenants
    await searchable(conn, [ChunkSpec(f"general policy clause {n}") for n in range(4 * CAP)])
    await searchable(conn, [ChunkSpec("policy on refunds for damaged goods")], title="Refunds")
    await searchable(conn, [ChunkSpec("damaged parcels are refunded")], read=("group:other",))
    await searchable(conn, [ChunkSpec("damaged parcels are returned")])
    await searchable(conn, [ChunkSpec(f"standard terms {n}") for n in range(2 * CAP)])
    await conn.execute("ANALYZE knowledge_chunk")
    cases = {
        # rarer words only: no common word to fill with
        "refunds damaged": KeywordKinds(any_word=True, rarest_word=False),
        # common words only: no rarer word to choose candidates
        "general policy": KeywordKinds(any_word=False, rarest_word=True),
        # two common words never together: the rarest fills the list, no rarer word
        "policy terms": KeywordKinds(any_word=False, rarest_word=True),
        # the user's syntax: every word, nothing else
        '"damaged goods"': KeywordKinds(any_word=False, rarest_word=False),
        # both
        "refunds policy details": ALL_KEYWORD_KINDS,
    }
    found: dict[str, list[str]] = {}
    for query, kinds in cases.items():
        request = SearchRequest("acme", query, ("group:all",), top_k=3, mode=SearchMode.KEYWORD)
        terms, _ = await keyword_plan(conn, index, request, path=path)
        assert KeywordKinds.of(terms.any_word, terms.rarest_word) == kinds, query
        rows = await keyword_rows(conn, index, request, path, kinds)
        assert rows == await keyword_rows(conn, index, request, path, ALL_KEYWORD_KINDS), query
        assert rows, query
        found[query] = [row[-1] for row in rows]
    # The kinds kept fill the list: the rarer words beyond the one chunk holding both, the
    # rarest common word where no chunk holds both.
    assert "damaged parcels are returned" in found["refunds damaged"]
    assert all(text.startswith("standard terms") for text in found["policy terms"])
    assert found["policy terms"]


@pytest.mark.parametrize("path", list(VectorPath), ids=lambda p: str(p.value))
async def test_the_full_text_index_finds_only_the_tenants_matches(
    conn_with_tenants: asyncpg.Connection[Any], index: PgSearchIndex, path: VectorPath
) -> None:
    # The tenant is the full-text index's first column (migrations/0018): the index scan
    # yields the tenant's matches only, and no other tenant's row is read to be filtered out
    # -- globex holds the same words many times over (in the same partition or not: the
    # index condition names the tenant either way).
    conn = conn_with_tenants
    for n in range(3):
        await searchable(conn, [ChunkSpec(f"refunds for damaged goods {n}")])
    for n in range(100):
        await searchable(conn, [ChunkSpec(f"general terms {n}")])
    for n in range(60):
        await searchable(conn, [ChunkSpec(f"refunds for damaged goods {n}")], tenant="globex")
    await conn.execute("VACUUM ANALYZE")
    request = SearchRequest(
        "acme", "damaged refunds", ("group:all",), top_k=10, mode=SearchMode.KEYWORD
    )
    await conn.execute("SET enable_seqscan = off")  # tables this small: a scan is cheaper
    try:
        _, plan = await keyword_plan(
            conn, index, request, analyze=True, path=path, kinds=ALL_KEYWORD_KINDS
        )
    finally:
        await conn.execute("RESET enable_seqscan")
    full_text = [
        node
        for node in walk(plan)
        if node["Node Type"] == "Bitmap Index Scan"
        and "search_document" in node["Index Name"]
        and node.get("Actual Loops", 0) > 0
    ]
    assert full_text, "the full-text index was not used"
    for node in full_text:
        assert "tenant_id = 'acme'" in node["Index Cond"], node["Index Cond"]
        assert "search_document @@" in node["Index Cond"], node["Index Cond"]
        assert node["Actual Rows"] <= 3  # acme's three matches, none of globex's 60
    found = await keyword(index, request.query)
    assert sorted(found) == [f"refunds for damaged goods {n}" for n in range(3)]


async def neighbour_of(conn: asyncpg.Connection[Any], tenant: str) -> str:
    """A tenant whose chunks share ``tenant``'s partition of knowledge_chunk."""
    partitions = await conn.fetchval(
        "SELECT count(*) FROM pg_inherits WHERE inhparent = 'knowledge_chunk'::regclass"
    )
    same = """SELECT bool_or(satisfies_hash_partition('knowledge_chunk'::regclass, $3, r, $1::text)
                      AND satisfies_hash_partition('knowledge_chunk'::regclass, $3, r, $2::text))
                FROM generate_series(0, $3 - 1) AS r"""
    for n in range(10_000):
        if await conn.fetchval(same, tenant, f"neighbour-{n}", partitions):
            return f"neighbour-{n}"
    raise AssertionError("no tenant shares the partition")


async def test_a_neighbours_words_do_not_make_the_tenants_words_common(
    conn_with_tenants: asyncpg.Connection[Any], index: PgSearchIndex
) -> None:
    # A tenant hashed to acme's partition says "policy" in 4 * CAP chunks; acme in two. The
    # partition's ANALYZE statistics would call "policy" common for acme too, and acme's
    # question would try its "policy" chunks last; acme's own counts call it rare.
    conn = conn_with_tenants
    neighbour = await neighbour_of(conn, "acme")
    await conn.execute("INSERT INTO tenant (tenant_id, tier) VALUES ($1, 'standard')", neighbour)
    for n in range(4 * CAP):
        await searchable(conn, [ChunkSpec(f"general policy clause {n}")], tenant=neighbour)
    await searchable(conn, [ChunkSpec("travel policy for contractors")])
    await searchable(conn, [ChunkSpec("policy on refunds")])
    await conn.execute("ANALYZE knowledge_chunk")
    partition_says = await conn.fetchval(
        """SELECT e.fraction * c.reltuples
             FROM pg_class c
             JOIN pg_stats s ON s.tablename = c.relname AND s.attname = 'search_document'
            CROSS JOIN LATERAL unnest(s.most_common_elems::text::text[],
                                      s.most_common_elem_freqs) AS e(lexeme, fraction)
            WHERE c.oid = (SELECT tableoid FROM knowledge_chunk WHERE tenant_id = 'acme' LIMIT 1)
              AND e.lexeme = 'policy'"""
    )
    assert partition_says > CAP  # what the partition's statistics would have told acme

    acme = await read_word_sample(conn, "acme", EMBEDDER.model, SETTINGS)
    assert acme.sampled == 2
    assert acme.common_lexemes() == {"policy": 2.0}
    request = SearchRequest(
        "acme", "contractors policy details", ("group:all",), top_k=5, mode=SearchMode.KEYWORD
    )
    terms, _ = await keyword_plan(conn, index, request)
    assert terms.any_word is not None
    assert "'policy'" in terms.any_word
    assert terms.rarest_word is None
    found = await keyword(index, request.query)
    assert found[0] == "travel policy for contractors"
    assert sorted(found) == ["policy on refunds", "travel policy for contractors"]

    theirs = await read_word_sample(conn, neighbour, EMBEDDER.model, SETTINGS)
    assert theirs.common_lexemes()["policy"] == 4 * CAP  # all read: exact


async def test_a_big_tenants_word_counts_are_estimated_from_a_sample(
    conn_with_tenants: asyncpg.Connection[Any],
) -> None:
    # 150 one-chunk documents, a third saying "policy", sampled 100 at a time: the sample's
    # counts stand for the 150 chunks the pointers serve. Another model's chunks (a
    # generation being built) are not counted.
    conn = conn_with_tenants
    for n in range(150):
        text = f"policy clause {n}" if n % 3 == 0 else f"general clause {n}"
        await searchable(conn, [ChunkSpec(text)])
    settings = SETTINGS.model_copy(update={"search_statistics_sample_chunks": 100})
    sample = await read_word_sample(conn, "acme", EMBEDDER.model, settings)
    assert (sample.sampled, sample.tenant_chunks()) == (100, 150)
    common = sample.common_lexemes()
    assert common["clause"] == 150
    assert 25 <= common["policy"] <= 90  # 50
    other_model = await read_word_sample(conn, "acme", "another-model", settings)
    assert (other_model.sampled, other_model.common_lexemes()) == (0, {})
