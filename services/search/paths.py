"""The lists' paths (statements.VectorPath): chosen by counting what the principals may read
and looking up the graphs there are to walk (search.sql: choose_vector_path), kept a short
while per tenant, principal set and document filter, and set up in the search's transaction
(statements.vector_path_settings_sql). The vector list walks a graph only when one exists;
the keyword list's plan follows the count alone (PathChoice.keyword_path).

Counting the chunks the principals may read, up to the exact-ranking threshold, takes a
noticeable share of a search for a principal who reads much of a large tenant: on every
search, until kept. A choice only decides how fast the lists are found, never which chunks
are eligible: the version and ACL filters are in every statement whatever the path.
A stale choice (the principals gained or lost access since) therefore costs time, not
correctness, and at most ``ttl_seconds`` of it.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeAlias

import asyncpg

from services.index.ann import ann_index_name, tenant_ann_index_name
from services.search.kept import KeptFor
from services.search.searcher import Generation, SearchRequest
from services.search.statements import (
    QUERIES,
    SearchSettings,
    VectorPath,
    vector_path_settings_sql,
)

Connection: TypeAlias = "asyncpg.Connection[Any] | asyncpg.pool.PoolConnectionProxy[Any]"
# The keyword list's path, awaited once its terms are read (the path's settings turn custom
# plans on, which keyword_terms must not get).
PathSource: TypeAlias = Callable[[], Awaitable[VectorPath]]

# (tenant, principals in order, document ids filter in order or None)
PathKey: TypeAlias = tuple[str, tuple[str, ...], tuple[uuid.UUID, ...] | None]


@dataclass(frozen=True)
class PathChoice:
    # The vector list's: ANN only when broad and there is a graph to walk.
    path: VectorPath
    # The tenant has a valid graph of its own (tenant_graphs): it sets the ef_search.
    tenant_graph: bool
    # The principals may read more than search_exact_max_chunks chunks.
    broad: bool

    @property
    def keyword_path(self) -> VectorPath:
        """The keyword list's plan follows how much the principals read, graph or not:
        broad readers probe each full-text candidate (statement_fragments.pgsql)."""
        return VectorPath.ANN if self.broad else VectorPath.EXACT


def path_key(request: SearchRequest) -> PathKey:
    """What a choice depends on: the heading filter is left out (the count ignores it)."""
    document_ids = request.filter.document_ids
    return (
        request.tenant_id,
        tuple(sorted(set(request.principals))),
        tuple(sorted(set(document_ids))) if document_ids is not None else None,
    )


class PathCache(KeptFor[PathKey, PathChoice]):
    """At most ``max_entries`` choices, each for ``ttl_seconds`` (0: none kept); the least
    recently used goes first."""


class VectorPaths:
    """Chooses, keeps and sets up the vector path of one generation's searches."""

    def __init__(self, generation: Generation, settings: SearchSettings) -> None:
        self._generation = generation
        self._settings = settings
        self._cache = PathCache(
            settings.search_path_cache_seconds, settings.search_path_cache_entries
        )

    def kept(self, request: SearchRequest) -> PathChoice | None:
        return self._cache.get(path_key(request))

    def kept_path_or_exact(self, request: SearchRequest) -> PathSource:
        """For a list that does not choose: the kept path, else EXACT's (the keyword list
        then starts from the readable documents, as for few of them)."""
        kept = self.kept(request)
        path = kept.keyword_path if kept is not None else VectorPath.EXACT

        async def source() -> VectorPath:
            return path

        return source

    async def set_up(
        self, conn: Connection, request: SearchRequest, kept: PathChoice | None = None
    ) -> PathChoice:
        """ANN when the principals may read more than ``search_exact_max_chunks`` chunks of
        the tenant and there is a graph to walk (the tenant's own, or the model's
        partitioned index), else EXACT: how the vector list finds its chunks (and, by
        ``keyword_path``, whether the keyword list probes its candidates or starts from the
        readable documents). Sets the transaction up for the vector path: call it inside
        the search's transaction, before the statement. ``kept``: a choice already looked
        up."""
        choice = kept or await self._choice(conn, request)
        await conn.execute(self.settings_sql(request, choice))
        return choice

    def settings_sql(self, request: SearchRequest, choice: PathChoice) -> str:
        """The SET LOCAL statements of ``choice`` (statements.vector_path_settings_sql), for
        a transaction that knows its path before it starts."""
        settings = self._settings
        ef_search = (
            settings.search_tenant_graph_ef_search
            if choice.tenant_graph
            else settings.search_ef_search
        )
        # At least the list's depth: an HNSW scan yields at most ef_search rows.
        ef_search = min(1000, max(ef_search, request.depth))
        return vector_path_settings_sql(choice.path, ef_search, settings.search_max_scan_tuples)

    async def _choice(self, conn: Connection, request: SearchRequest) -> PathChoice:
        key = path_key(request)
        choice = self._cache.get(key)
        if choice is None:
            document_ids = request.filter.document_ids
            row = await conn.fetchrow(
                QUERIES["choose_vector_path"],
                request.tenant_id,
                list(request.principals),
                self._generation.embedding_model,
                list(document_ids) if document_ids is not None else None,
                self._settings.search_exact_max_chunks,
                self._tenant_graph(request.tenant_id),
                ann_index_name(self._generation.embedding_model),
            )
            if row is None:  # one-row subqueries cross-joined: always one row
                raise AssertionError("choose_vector_path returned no row")
            choice = PathChoice(VectorPath(row["path"]), row["tenant_graph"], row["broad"])
            self._cache.put(key, choice)
        return choice

    def _tenant_graph(self, tenant_id: str) -> str | None:
        """The name the tenant's own graph has if it has one (tenant_graphs)."""
        try:
            return tenant_ann_index_name(self._generation.embedding_model, tenant_id)
        except ValueError:  # not a tenant id the publisher admits: it has no graph
            return None
