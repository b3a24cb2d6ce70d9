"""Search's SQL (``search.sql``) and settings: the statements specialised per embedding model
and vector path, and what tunes them (``KB_SEARCH_*``)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from functools import cache
from typing import Final

from pydantic import Field

from services.index.ann import model_predicate, vector_expression
from services.runtime.settings import RuntimeSettings
from services.runtime.sql import indented, queries_beside

QUERIES = queries_beside(__file__, "search.sql")

# What search.sql is written for; replaced by the real model's predicate and expression.
TEMPLATE_MODEL: Final = "search-template-model"
TEMPLATE_DIMENSION: Final = 1
_ALIASES: Final = ("s", "c")
_TEMPLATE_DIMENSION_PREDICATE: Final = f"c.embedding_dimension = {TEMPLATE_DIMENSION}"
# Where a statement may probe per candidate (search.sql: searchable_chunks).
_PROBE: Final = "/*probe*/"


class VectorPath(Enum):
    """How the vector list finds the nearest readable chunks (search.sql: vector_list)."""

    # Walk the tenant partition's HNSW graph, filters probed per candidate, iterating.
    ANN = "ann"
    # Rank every chunk the principals may read: exact, and cheap while they are few.
    EXACT = "exact"


class SearchSettings(RuntimeSettings):
    # HNSW candidate list size: recall against latency. Each search uses at least its depth.
    # 600: recall@10 0.958 against the exact answer on the 1M-chunk bench (400: 0.93; 100:
    # 0.86), at ~13 ms for the graph walk there (BENCHMARKS.md). Only the ANN path uses it.
    search_ef_search: int = Field(default=600, ge=10, le=1000)
    # The same for a tenant with a graph of its own (KB_INDEXER_TENANT_GRAPH_MIN_CHUNKS):
    # 200 gives recall@10 0.965 on the 1M bench where the partition's graph needs 600.
    search_tenant_graph_ef_search: int = Field(default=200, ge=10, le=1000)
    # How many index tuples an iterative scan may visit before it gives up: bounds the cost
    # of a search whose principals may read only a sliver of the tenant.
    search_max_scan_tuples: int = Field(default=20_000, ge=1_000, le=10_000_000)
    # Principals who may read at most this many chunks of the tenant (current versions) get
    # them all ranked exactly (recall 1); more go through the tenant partition's HNSW index.
    # 0: always the index. Ranking costs ~3 us a chunk (the vector is in the row): 5,000
    # chunks take about what the graph walk takes (bench/search_latency.py, BENCHMARKS.md).
    search_exact_max_chunks: int = Field(default=5_000, ge=0, le=10_000_000)
    # How many chunks matching the query's words the keyword list ranks at most, of each
    # kind (all words; any of the rarer words): bounds a keyword search's cost whatever the
    # query, at the price of ranking only that many of the matches of very common words.
    # A search ranks at least its depth.
    search_keyword_candidates: int = Field(default=250, ge=10, le=100_000)
    # How long a principal set's vector path (exact or ANN, and whether the tenant has a
    # graph of its own) is reused before it is counted again (search_paths). The path
    # decides speed only: every path filters by version and ACL. 0: counted on every search.
    search_path_cache_seconds: float = Field(default=30.0, ge=0, le=3600)
    # How many principal sets' paths are kept, per process.
    search_path_cache_entries: int = Field(default=10_000, ge=1, le=1_000_000)
    # How long the keyword list keeps a tenant partition's word statistics (how many chunks
    # hold each of its commonest words, from ANALYZE) before it reads them again
    # (keyword_terms). They steer which candidates are tried first, never which chunks are
    # eligible. 0: read on every keyword search.
    search_statistics_cache_seconds: float = Field(default=60.0, ge=0, le=3600)
    # How long a search waits for a connection before answering 503.
    search_acquire_timeout_seconds: float = Field(default=5.0, gt=0, le=60)


# The planner settings vector_path_settings_sql changes (undo_vector_path restores them).
PLANNER_SETTINGS: Final = (
    "enable_sort",
    "enable_hashjoin",
    "enable_mergejoin",
    "enable_material",
    "enable_bitmapscan",
    "max_parallel_workers_per_gather",
    "plan_cache_mode",
)


def vector_path_settings_sql(path: VectorPath, ef_search: int, max_scan_tuples: int) -> str:
    """SET LOCAL statements for the vector list's path, run in its transaction before it
    (one round trip; integers and fixed words only).

    pgvector >= 0.8 iterative index scans: when the version and ACL probes reject most of
    what the HNSW scan yields, the scan goes on (up to ``max_scan_tuples``) instead of
    returning fewer than LIMIT rows; relaxed_order may hand rows back slightly out of
    distance order, and the statement ranks them by distance anyway.

    Custom plans: a generic plan would not see the tenant (to prune to its partition at
    planning) nor the LIMIT's value. Hash and merge joins off on both paths: the lists join
    a few hundred rows at most, by index, and the planner -- estimating the tenant's
    readable documents at a hundredth of what they are (it takes document ids to be
    independent of the tenant) -- would hash every search pointer of the tenant instead.
    On the ANN path sorting and materializing go off too: with sorting disabled the plan
    without a disabled node, the HNSW index's order, wins over sorting the tenant's chunks;
    the graph yields a few dozen candidates, and probing each one's pointer and ACL rows by
    index costs microseconds where collecting the readable documents first (and, estimated
    at a dozen, scanning them again per candidate) cost milliseconds (1M bench, whole
    tenant: 20 ms instead of 13). On the exact path bitmap scans go off: the readable
    documents' pointers are read by one index scan of the documents listed from the ACL
    (search.sql: searchable_chunks_listed) rather than every pointer of the tenant read
    from the heap. On both paths no parallel plans: a list reads a few thousand rows at most,
    where starting workers would cost more than they save; the planner never chose one for
    these lists, and no longer costs them out for every scan (1M bench: the same plans for
    every principal set, planning 0.05-0.15 ms shorter)."""
    if not (isinstance(ef_search, int) and isinstance(max_scan_tuples, int)):
        raise TypeError("ef_search and max_scan_tuples are integers")
    ann = path is VectorPath.ANN
    values = {
        "hnsw.iterative_scan": "relaxed_order",
        "hnsw.max_scan_tuples": str(max_scan_tuples),
        "hnsw.ef_search": str(ef_search),
        "enable_sort": "off" if ann else "on",
        "enable_hashjoin": "off",
        "enable_mergejoin": "off",
        "enable_material": "off" if ann else "on",
        "enable_bitmapscan": "on" if ann else "off",
        "max_parallel_workers_per_gather": "0",
        "plan_cache_mode": "force_custom_plan",
    }
    return "".join(f"SET LOCAL {name} = {value};" for name, value in values.items())


VECTOR_STATEMENT: Final = "search_vector_candidates"
KEYWORD_STATEMENT: Final = "search_keyword_candidates"


@dataclass(frozen=True)
class KeywordKinds:
    """Which of the keyword list's later kinds of candidates a query's terms can find
    (search.sql: keyword_any_word needs a rarer word, $7; keyword_rarest_word a common one,
    $8); the first kind, chunks holding every word, is always there."""

    any_word: bool = True
    rarest_word: bool = True

    @classmethod
    def of(cls, any_word: str | None, rarest_word: str | None) -> KeywordKinds:
        return cls(any_word=any_word is not None, rarest_word=rarest_word is not None)


ALL_KEYWORD_KINDS: Final = KeywordKinds()
KEYWORD_KINDS: Final = tuple(
    KeywordKinds(any_word, rarest_word)
    for any_word in (True, False)
    for rarest_word in (True, False)
)


@cache
def specialised_search_sql(
    model: str,
    dimension: int,
    name: str = VECTOR_STATEMENT,
    path: VectorPath = VectorPath.ANN,
    kinds: KeywordKinds = ALL_KEYWORD_KINDS,
) -> str:
    """A search statement with the model's predicate and vector expression as literals,
    built from ann_index (which admits only safe model names), never from user input; one
    text per model and path (and, for the keyword list, per kinds of candidates its terms
    can find), so the server can cache its plan shape. The exact path ranks every readable
    chunk by the bare column, which no graph serves, from the leaves of a btree holding the
    vectors (search.sql: vector_list_exact); on the ANN path the keyword list probes each
    candidate's version and ACL (search.sql: searchable_chunks). A keyword list whose query
    has no rarer word, or no common one, leaves out that kind's scan (search.sql:
    keyword_no_candidates)."""
    sql = QUERIES[name]
    if name == KEYWORD_STATEMENT:
        for kind, cte in (
            (kinds.any_word, "keyword_any_word"),
            (kinds.rarest_word, "keyword_rarest_word"),
        ):
            if not kind:
                sql = _emptied_cte(sql, cte)
    elif kinds != ALL_KEYWORD_KINDS:
        raise ValueError("only the keyword list has kinds of candidates")
    replacements = [
        (
            model_predicate(TEMPLATE_MODEL, f"{alias}.embedding_model"),
            model_predicate(model, f"{alias}.embedding_model"),
        )
        for alias in _ALIASES
    ]
    if name == VECTOR_STATEMENT:
        if path is VectorPath.ANN:
            replacements.append(
                (
                    vector_expression(TEMPLATE_DIMENSION, "c.embedding"),
                    vector_expression(dimension, "c.embedding"),
                )
            )
        else:
            # Every readable chunk ranked, from the exact list's index (search.sql).
            sql = _swap_included(sql, "vector_list", "vector_list_exact")
            vector_expression(dimension)  # checks the dimension is one
            replacements.append(
                (_TEMPLATE_DIMENSION_PREDICATE, f"c.embedding_dimension = {int(dimension)}")
            )
    if name == KEYWORD_STATEMENT and path is VectorPath.ANN:
        replacements.append((_PROBE, "OFFSET 0"))
    for template, replacement in replacements:
        if template not in sql:
            raise AssertionError(f"search.sql lost its template expression {template!r}")
        sql = sql.replace(template, replacement)
    if TEMPLATE_MODEL in sql:
        raise AssertionError("search.sql names the template model outside a model predicate")
    return sql


def _swap_included(sql: str, included: str, replacement: str) -> str:
    """``sql`` with the text of query ``included`` (put there by an include line, indented as
    that line was: runtime.sql) replaced by the text of query ``replacement``, alike."""
    first_line = QUERIES[included].splitlines()[0]
    found = re.search(rf"^([ \t]*){re.escape(first_line)}$", sql, re.MULTILINE)
    indent = found.group(1) if found else ""
    text = indented(QUERIES[included], indent)
    if sql.count(text) != 1:
        raise AssertionError(f"search.sql's statement lost its inclusion of {included!r}")
    return sql.replace(text, indented(QUERIES[replacement], indent))


def _emptied_cte(sql: str, cte: str) -> str:
    """``sql`` with the body of its MATERIALIZED CTE ``cte`` (up to the line closing it) replaced
    by keyword_no_candidates, which finds nothing."""
    found = re.search(rf"^{re.escape(cte)} AS MATERIALIZED \(\n(.*?)\n\),$", sql, re.M | re.S)
    if found is None or sql.count(f"{cte} AS MATERIALIZED (") != 1:
        raise AssertionError(f"search.sql's keyword statement lost its CTE {cte!r}")
    body = indented(QUERIES["keyword_no_candidates"], "    ")
    return sql[: found.start(1)] + body + sql[found.end(1) :]
