"""The search index on PostgreSQL: pgvector HNSW and full-text candidate lists in one
statement, in a short read-only transaction (the SQL is in ``search.sql``)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Coroutine
from enum import Enum
from functools import cache
from typing import Any, Final, TypeAlias

import asyncpg
import numpy as np
from pydantic import Field

from services.indexer.ann_index import model_predicate, vector_expression
from services.indexer.embedding.port import Vectors
from services.indexer.search import (
    Candidate,
    Candidates,
    Generation,
    SearchMode,
    SearchRequest,
)
from services.runtime.db import translate_db_errors
from services.runtime.settings import RuntimeSettings
from services.runtime.sql import queries_beside

QUERIES = queries_beside(__file__, "search.sql")

# What search.sql is written for; replaced by the real model's predicate and expression.
TEMPLATE_MODEL: Final = "search-template-model"
TEMPLATE_DIMENSION: Final = 1
_ALIASES: Final = ("s", "c")
# How long hybrid search waits for a second connection before running its lists in turn.
_SECOND_CONNECTION_WAIT_SECONDS: Final = 0.005
_SNAPSHOT_ID: Final = re.compile(r"[0-9A-F]+-[0-9A-F]+-[0-9]+")
# keyword_terms' columns, in search_keyword_candidates' parameter order ($6..$10).
_TERMS: Final = ("strict", "any_word", "rarest_word", "ranking", "lexemes")


Connection: TypeAlias = "asyncpg.Connection[Any] | asyncpg.pool.PoolConnectionProxy[Any]"


# Reads one ranked list on a connection.
ListReader: TypeAlias = Callable[[Connection], Coroutine[Any, Any, list[asyncpg.Record]]]


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
    by the bare column, which no index serves."""
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
    for template, replacement in replacements:
        if template not in sql:
            raise AssertionError(f"search.sql lost its template expression {template!r}")
        sql = sql.replace(template, replacement)
    if TEMPLATE_MODEL in sql:
        raise AssertionError("search.sql names the template model outside a model predicate")
    return sql


class PgSearchIndex:
    def __init__(
        self,
        pool: asyncpg.Pool[Any],
        generation: Generation,
        settings: SearchSettings | None = None,
    ) -> None:
        self._pool = pool
        self._generation = generation
        self._settings = settings or SearchSettings()
        model, dimension = generation.embedding_model, generation.dimension
        self._vector_sql = {
            path: specialised_search_sql(model, dimension, VECTOR_STATEMENT, path)
            for path in VectorPath
        }
        self._keyword_sql = specialised_search_sql(model, dimension, KEYWORD_STATEMENT)
        # tenant -> its partition of knowledge_chunk (one short string per tenant searched).
        self._partitions: dict[str, str] = {}

    @property
    def generation(self) -> Generation:
        return self._generation

    def vector_statement(self, path: VectorPath) -> str:
        return self._vector_sql[path]

    async def vector_path(
        self,
        conn: Connection,
        request: SearchRequest,
    ) -> VectorPath:
        """ANN when the principals may read more than ``search_exact_max_chunks`` chunks of
        the tenant, else EXACT (and EXACT when no vector list is wanted: it is not run).
        Sets the transaction up for the path (search.sql: choose_vector_path): call it
        inside the search's transaction, before the statement."""
        if not request.mode.uses_vector:
            return VectorPath.EXACT
        flt = request.filter
        path = await conn.fetchval(
            QUERIES["choose_vector_path"],
            request.tenant_id,
            list(request.principals),
            self._generation.embedding_model,
            list(flt.document_ids) if flt.document_ids is not None else None,
            self._settings.search_exact_max_chunks,
        )
        return VectorPath(path)

    async def _tenant_partition(self, conn: Connection, tenant_id: str) -> str | None:
        partition = self._partitions.get(tenant_id)
        if partition is None:
            partition = await conn.fetchval(QUERIES["tenant_partition"], tenant_id)
            if partition is not None:  # a tenant's partition never changes
                self._partitions[tenant_id] = partition
        return partition

    async def candidates(self, request: SearchRequest, query_vector: Vectors | None) -> Candidates:
        vector = None
        if request.mode.uses_vector:
            if query_vector is None:
                raise ValueError("a vector search needs the query's vector")
            vector = np.asarray(query_vector, dtype=np.float32).reshape(-1)
        flt = request.filter
        # search.sql's $1 to $5, the same in both statements.
        searchable = (
            request.tenant_id,
            list(request.principals),
            list(flt.document_ids) if flt.document_ids is not None else None,
            list(flt.heading_prefix) if flt.heading_prefix is not None else None,
            request.depth,
        )

        async def keyword_list(conn: Connection) -> list[asyncpg.Record]:
            return await self._keyword_list(conn, request, searchable)

        async def vector_list(conn: Connection) -> list[asyncpg.Record]:
            path = await self.vector_path(conn, request)
            return await conn.fetch(self._vector_sql[path], *searchable, vector)

        with translate_db_errors():
            async with (
                self._pool.acquire(timeout=self._settings.search_acquire_timeout_seconds) as conn,
                # One snapshot for both lists, taken by the first statement.
                conn.transaction(readonly=True, isolation="repeatable_read"),
            ):
                await self._configure(conn, request)
                if request.mode is SearchMode.HYBRID:
                    rows = await self._both_lists(conn, request, keyword_list, vector_list)
                elif request.mode.uses_keyword:
                    rows = await keyword_list(conn)
                else:
                    rows = await vector_list(conn)
        return _candidates(rows)

    async def _configure(self, conn: Connection, request: SearchRequest) -> None:
        await conn.execute(
            QUERIES["configure_search_transaction"],
            min(1000, max(self._settings.search_ef_search, request.depth)),
            self._settings.search_max_scan_tuples,
        )

    async def _keyword_list(
        self, conn: Connection, request: SearchRequest, searchable: tuple[Any, ...]
    ) -> list[asyncpg.Record]:
        cap = max(self._settings.search_keyword_candidates, request.depth)
        terms = await conn.fetchrow(
            QUERIES["keyword_terms"],
            request.tenant_id,
            request.query,
            cap,
            await self._tenant_partition(conn, request.tenant_id),
        )
        if terms is None:  # an unknown tenant has nothing to match
            return []
        return await conn.fetch(self._keyword_sql, *searchable, *(terms[t] for t in _TERMS), cap)

    async def _both_lists(
        self,
        conn: Connection,
        request: SearchRequest,
        keyword_list: ListReader,
        vector_list: ListReader,
    ) -> list[asyncpg.Record]:
        """Hybrid: the two lists at once, on two connections sharing ``conn``'s snapshot
        (exported, and imported by the second's transaction before anything else), so they
        still see each document at one version. Without a free connection right away, in
        turn on ``conn``: waiting for a second while holding the first could starve the
        pool. The keyword list runs first there, before the ANN path's settings."""
        snapshot = await conn.fetchval(QUERIES["export_snapshot"])
        try:
            second = await self._pool.acquire(timeout=_SECOND_CONNECTION_WAIT_SECONDS)
        except TimeoutError:
            return await keyword_list(conn) + await vector_list(conn)
        try:
            async with second.transaction(readonly=True, isolation="repeatable_read"):
                await second.execute(import_snapshot_sql(snapshot))
                await self._configure(second, request)
                try:
                    async with asyncio.TaskGroup() as group:
                        keyword = group.create_task(keyword_list(conn))
                        vector = group.create_task(vector_list(second))
                except ExceptionGroup as failed:  # the first failure, as if run in turn
                    raise failed.exceptions[0] from None
                return keyword.result() + vector.result()
        finally:
            # Not the acquire's few milliseconds, which asyncpg would take for the reset.
            await self._pool.release(second, timeout=self._settings.search_acquire_timeout_seconds)


def import_snapshot_sql(snapshot: str) -> str:
    """SET TRANSACTION SNAPSHOT takes no parameter; the id comes from pg_export_snapshot(),
    and is checked to be one before it goes into the text."""
    if not _SNAPSHOT_ID.fullmatch(snapshot):
        raise ValueError(f"{snapshot!r} is not a snapshot id")
    return f"SET TRANSACTION SNAPSHOT '{snapshot}'"


def _candidates(rows: list[asyncpg.Record]) -> Candidates:
    vector_list: list[Candidate] = []
    keyword_list: list[Candidate] = []
    for row in rows:
        candidate = Candidate(
            document_id=row["document_id"],
            title=row["title"],
            version_number=row["version_number"],
            chunk_id=row["chunk_id"],
            heading_path=tuple(row["heading_path"]),
            text=row["text"],
            rank=row["rank"],
            score=float(row["score"]),
            coverage=row["coverage"],
        )
        (vector_list if row["list"] == SearchMode.VECTOR.value else keyword_list).append(candidate)
    return Candidates(vector=vector_list, keyword=keyword_list)
