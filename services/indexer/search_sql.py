"""Search's SQL (``search.sql``) and settings: the statements specialised per embedding model
and vector path, and what tunes them (``KB_SEARCH_*``)."""

from __future__ import annotations

from enum import Enum
from functools import cache
from typing import Final

from pydantic import Field

from services.indexer.ann_index import model_predicate, vector_expression
from services.runtime.settings import RuntimeSettings
from services.runtime.sql import queries_beside

QUERIES = queries_beside(__file__, "search.sql")

# What search.sql is written for; replaced by the real model's predicate and expression.
TEMPLATE_MODEL: Final = "search-template-model"
TEMPLATE_DIMENSION: Final = 1
_ALIASES: Final = ("s", "c")
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
    # How long a search waits for a connection before answering 503.
    search_acquire_timeout_seconds: float = Field(default=5.0, gt=0, le=60)


VECTOR_STATEMENT: Final = "search_vector_candidates"
KEYWORD_STATEMENT: Final = "search_keyword_candidates"


@cache
def specialised_search_sql(
    model: str,
    dimension: int,
    name: str = VECTOR_STATEMENT,
    path: VectorPath = VectorPath.ANN,
) -> str:
    """A search statement with the model's predicate and vector expression as literals,
    built from ann_index (which admits only safe model names), never from user input; one
    text per model and path, so the server can cache its plan shape. The exact path orders
    by the bare column, which no index serves; on the ANN path the keyword list probes each
    candidate's version and ACL (search.sql: searchable_chunks)."""
    sql = QUERIES[name]
    replacements = [
        (
            model_predicate(TEMPLATE_MODEL, f"{alias}.embedding_model"),
            model_predicate(model, f"{alias}.embedding_model"),
        )
        for alias in _ALIASES
    ]
    if name == VECTOR_STATEMENT:
        expression = vector_expression(TEMPLATE_DIMENSION, "c.embedding")
        exact = "c.embedding"
        replacements.append(
            (
                expression,
                vector_expression(dimension, "c.embedding") if path is VectorPath.ANN else exact,
            )
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
