"""The search index on PostgreSQL: the vector and full-text candidate lists, read in one
short read-only REPEATABLE READ transaction (the statements: ``statements``)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Coroutine, Mapping
from contextlib import AbstractContextManager
from typing import Any, Final, TypeAlias

import asyncpg
import numpy as np
from opentelemetry.trace import Span

from services.embedding.port import Vectors
from services.runtime.pg.db import translate_db_errors
from services.runtime.pg.records import from_row
from services.runtime.tenancy.tenant_wall import tenant_wall_sql, walls_search
from services.runtime.tracing.spans import Attributes, span_under
from services.search.connections import SearchConnections
from services.search.keyword_terms import (
    QueryWords,
    TenantStatistics,
    WordSample,
    keyword_terms,
    sample_start,
    word_sample,
)
from services.search.paths import Connection, PathChoice, PathSource, VectorPaths
from services.search.searcher import (
    Candidate,
    Candidates,
    Generation,
    SearchMode,
    SearchRequest,
)
from services.search.statements import (
    ALL_KEYWORD_KINDS,
    KEYWORD_KINDS,
    KEYWORD_STATEMENT,
    PLANNER_SETTINGS,
    QUERIES,
    VECTOR_STATEMENT,
    KeywordKinds,
    SearchSettings,
    VectorPath,
    specialised_search_sql,
)

_SNAPSHOT_ID: Final = re.compile(r"[0-9A-F]+-[0-9A-F]+-[0-9]+")
# Every search's transaction: one snapshot for all its statements (and its two connections).
BEGIN_READ_ONLY: Final = "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY;"


# Reads one ranked list on a connection.
ListReader: TypeAlias = Callable[
    [Connection, VectorPath], Coroutine[Any, Any, list[asyncpg.Record]]
]
KeywordReader: TypeAlias = Callable[
    [Connection, PathSource], Coroutine[Any, Any, list[asyncpg.Record]]
]


class PgSearchIndex:
    def __init__(
        self,
        pool: asyncpg.Pool[Any],
        generation: Generation,
        settings: SearchSettings | None = None,
    ) -> None:
        self._generation = generation
        self._settings = settings or SearchSettings()
        model, dimension = generation.embedding_model, generation.dimension
        self._vector_sql = {
            path: specialised_search_sql(model, dimension, VECTOR_STATEMENT, path)
            for path in VectorPath
        }
        self._keyword_sql = {
            (path, kinds): specialised_search_sql(model, dimension, KEYWORD_STATEMENT, path, kinds)
            for path in VectorPath
            for kinds in KEYWORD_KINDS
        }
        self._connections = SearchConnections(pool, self._settings)
        self._paths = VectorPaths(generation, self._settings)
        self._statistics = TenantStatistics(
            self._settings.search_statistics_cache_seconds,
            self._settings.search_statistics_cache_entries,
        )
        # Whether searches run behind the tenant wall (KB_DB_ROW_SECURITY); auto: read from
        # the database on the first search (tenant_wall.walls_search).
        self._walled: bool | None = None

    @property
    def generation(self) -> Generation:
        return self._generation

    def vector_statement(self, path: VectorPath) -> str:
        return self._vector_sql[path]

    def keyword_statement(self, path: VectorPath, kinds: KeywordKinds = ALL_KEYWORD_KINDS) -> str:
        return self._keyword_sql[(path, kinds)]

    async def vector_path(
        self,
        conn: Connection,
        request: SearchRequest,
        kept: PathChoice | None = None,
    ) -> VectorPath:
        """The vector list's path, its transaction set up for it (paths.py)."""
        return (await self._paths.set_up(conn, request, kept)).path

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

        async def keyword_list(conn: Connection, path: PathSource) -> list[asyncpg.Record]:
            with list_span("keyword") as span:
                rows = await self._keyword_list(conn, request, searchable, path)
                span.set_attribute("db.response.returned_rows", len(rows))
            return rows

        async def vector_list(conn: Connection, path: VectorPath) -> list[asyncpg.Record]:
            with list_span("vector", path) as span:
                rows = await conn.fetch(self._vector_sql[path], *searchable, vector)
                span.set_attribute("db.response.returned_rows", len(rows))
            return rows

        with translate_db_errors():
            conn = await self._connections.acquire()
            try:
                rows = await self._lists(conn, request, keyword_list, vector_list)
            except BaseException:
                self._connections.end_later(conn, commit=False)
                raise
            self._connections.end_later(conn, commit=True)
        return _candidates(rows)

    async def _lists(
        self,
        conn: Connection,
        request: SearchRequest,
        keyword_list: KeywordReader,
        vector_list: ListReader,
    ) -> list[asyncpg.Record]:
        """The request's lists, in one read-only REPEATABLE READ transaction on ``conn``
        (hybrid: and a second connection in its snapshot), left open: the caller ends it.
        The transaction starts with a kept vector path's settings: one round trip."""
        kept = self._paths.kept(request) if request.mode.uses_vector else None
        if self._walled is None:
            self._walled = await walls_search(conn, self._settings.db_row_security)
        begin = BEGIN_READ_ONLY + self._wall(request)
        await conn.execute(begin + (self._paths.settings_sql(request, kept) if kept else ""))
        if request.mode is SearchMode.HYBRID:
            return await self._both_lists(conn, request, kept, keyword_list, vector_list)
        if request.mode.uses_keyword:
            # Without a vector list the path is not worth the time its count takes: the
            # keyword list follows a kept one, else starts from the readable documents, as
            # for few of them.
            return await keyword_list(conn, self._paths.kept_path_or_exact(request))
        path = kept.path if kept is not None else await self.vector_path(conn, request)
        return await vector_list(conn, path)

    def _wall(self, request: SearchRequest) -> str:
        """The statements putting the search's transaction behind the tenant wall
        (KB_DB_ROW_SECURITY; services/runtime/tenancy/tenant_wall.py), sent with its BEGIN."""
        return tenant_wall_sql(request.tenant_id) if self._walled else ""

    async def ended(self) -> None:
        """Waits for what answered searches left running (connections.settled)."""
        await self._connections.settled()

    async def _keyword_list(
        self,
        conn: Connection,
        request: SearchRequest,
        searchable: tuple[Any, ...],
        path: PathSource,
    ) -> list[asyncpg.Record]:
        cap = max(self._settings.search_keyword_candidates, request.depth)
        row = await conn.fetchrow(QUERIES["keyword_terms"], request.tenant_id, request.query)
        if row is None:  # an unknown tenant has nothing to match
            return []
        words = QueryWords(
            strict=row["strict"],
            natural=row["natural"],
            lexemes=tuple(row["lexemes"]),
            queries=tuple(row["queries"]),
        )
        terms = keyword_terms(words, await self._common_lexemes(conn, request.tenant_id), cap)
        kinds = KeywordKinds.of(terms.any_word, terms.rarest_word)
        return await conn.fetch(
            self._keyword_sql[(await path(), kinds)], *searchable, *terms.parameters(), cap
        )

    async def _common_lexemes(self, conn: Connection, tenant_id: str) -> Mapping[str, float]:
        async def read() -> WordSample:
            return await read_word_sample(
                conn, tenant_id, self._generation.embedding_model, self._settings
            )

        return await self._statistics.common(tenant_id, read)

    async def _both_lists(
        self,
        conn: Connection,
        request: SearchRequest,
        kept: PathChoice | None,
        keyword_list: KeywordReader,
        vector_list: ListReader,
    ) -> list[asyncpg.Record]:
        """Hybrid: the two lists at once, on two connections sharing ``conn``'s snapshot
        (exported, and imported by the second's transaction before anything else), so they
        still see each document at one version. The vector list, the longer of the two,
        starts on ``conn`` at once, choosing the paths of both lists unless a recent choice
        is kept (and set up with the transaction); the keyword list waits for the second
        connection and its path."""
        snapshot = await conn.fetchval(QUERIES["export_snapshot"])
        # The keyword list's path: it may differ from the vector list's (PathChoice).
        chosen: asyncio.Future[VectorPath] = asyncio.get_running_loop().create_future()
        if kept is not None:
            chosen.set_result(kept.keyword_path)

        async def vector_first() -> list[asyncpg.Record]:
            if kept is not None:
                return await vector_list(conn, kept.path)
            choice = await self._paths.set_up(conn, request)
            chosen.set_result(choice.keyword_path)
            return await vector_list(conn, choice.path)

        try:
            async with asyncio.TaskGroup() as group:
                vector = group.create_task(vector_first())
                keyword = group.create_task(
                    self._keyword_list_beside(
                        conn, vector, chosen, snapshot, keyword_list, self._wall(request)
                    )
                )
        except ExceptionGroup as failed:  # the first failure, as if run in turn
            raise failed.exceptions[0] from None
        return keyword.result() + vector.result()

    async def _keyword_list_beside(
        self,
        conn: Connection,
        vector: asyncio.Task[list[asyncpg.Record]],
        chosen: asyncio.Future[VectorPath],
        snapshot: str,
        keyword_list: KeywordReader,
        wall: str,
    ) -> list[asyncpg.Record]:
        """The keyword list on a second connection in ``snapshot`` (behind ``wall``, as
        the first); without a free one right
        away, on ``conn`` once the vector list is done with it (waiting for a second while
        holding the first could starve the pool), its path's planner settings undone. A
        failed vector list cancels this one through the TaskGroup, ``chosen`` or not."""
        second = await self._connections.idle()
        if second is None:
            await asyncio.wait([vector])  # its failure is the TaskGroup's to raise
            await conn.execute(QUERIES["undo_vector_path"], list(PLANNER_SETTINGS))
            return await keyword_list(conn, lambda: chosen)
        try:
            # One round trip: the transaction, its snapshot and the tenant wall.
            await second.execute(BEGIN_READ_ONLY + import_snapshot_sql(snapshot) + ";" + wall)
            rows = await keyword_list(second, lambda: chosen)
        except BaseException:
            self._connections.end_later(second, commit=False)
            raise
        self._connections.end_later(second, commit=True)
        return rows


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
        candidate = from_row(
            Candidate, row, heading_path=tuple(row["heading_path"]), score=float(row["score"])
        )
        (vector_list if row["list"] == SearchMode.VECTOR.value else keyword_list).append(candidate)
    return Candidates(vector=vector_list, keyword=keyword_list)


async def read_word_sample(
    conn: Connection, tenant_id: str, model: str, settings: SearchSettings
) -> WordSample:
    """The tenant's word sample of ``model``'s chunks (search.sql: tenant_common_lexemes)."""
    limit = settings.search_statistics_sample_chunks
    rows = await conn.fetch(
        QUERIES["tenant_common_lexemes"],
        tenant_id,
        str(sample_start(tenant_id)),
        limit,
        model,
        settings.search_statistics_lexemes,
    )
    return word_sample(limit, rows)


def list_span(kind: str, path: VectorPath | None = None) -> AbstractContextManager[Span]:
    """The span of one candidate list (``kind``: keyword or vector; a vector list's path:
    exact or ANN)."""
    attributes: Attributes = {"db.system.name": "postgresql", "db.operation.name": "SELECT"}
    if path is not None:
        attributes["kb.search.path"] = str(path.value)
    return span_under(f"kb.search.{kind}_list", None, attributes=attributes)
