"""Search reads each tenant's serving generation (docs/architecture.md#index-generations).

A tenant is served by one search generation at a time (migration 0022): its serving row in
``tenant_search_generation``, else the default generation. Each search reads which one
(search.sql: serving_generation), embeds the query with that generation's embedder and runs
the statements of its model; both are opened the first time a generation is searched and
kept until the app stops. A database without any generation yet (no indexer has registered
one) is searched as before generations: with the configured embedder (``KB_EMBEDDING_*``).

A switch (`kb index generations switch`) rewrites the tenant's search pointers to the new
generation's model and flips its serving row in one transaction. A search that read the old
generation before that commit and took its snapshot after it finds no pointer of the old
model: an empty answer. When an answer is empty and the tenant's serving generation has
changed meanwhile, the search runs once more with the new one; a second switch within that
retry is not chased (an empty answer, as for a search running while the pointers move).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import asyncpg

from services.embedding.port import Embedder
from services.index.generations import DEFAULT_PROFILE, SearchGeneration
from services.runtime.errors import (
    ConfigError,
    DatabaseBusy,
    DatabaseUnavailable,
    SerializationConflict,
)
from services.runtime.fair_share.phases import search_slot
from services.runtime.logging import get_logger
from services.runtime.pg.db import translate_db_errors
from services.search.index_pg import PgSearchIndex
from services.search.metrics import SEARCH_READS
from services.search.primary_position import PrimaryPosition
from services.search.read_pool import read_pool, reading_from
from services.search.replicas import PRIMARY, ReplicaRotation, ReplicaView, format_token
from services.search.searcher import Generation, Searcher, SearchRequest, SearchResult
from services.search.statements import QUERIES, SearchSettings

log = get_logger(__name__)

# Builds a generation's query embedder (``query_embedders``); raises ConfigError when this
# process cannot embed for it (its profile is not configured here, or names another model).
EmbedderFactory = Callable[[SearchGeneration], Embedder]


class ServingGenerations:
    """Which search generation serves a tenant, read from the database on every call."""

    def __init__(self, pool: asyncpg.Pool[Any], settings: SearchSettings) -> None:
        self._pool = pool
        self._timeout = settings.search_acquire_timeout_seconds

    async def serving(self, tenant_id: str) -> SearchGeneration | None:
        """The tenant's serving generation; None while the database has no generation to
        serve it (search then reads the configured model)."""
        with translate_db_errors():
            async with read_pool(self._pool).acquire(timeout=self._timeout) as conn:
                row = await conn.fetchrow(QUERIES["serving_generation"], tenant_id)
        return None if row is None else SearchGeneration.from_record(row)


class GenerationSearch:
    """The search route's ``SearchService``: each request searched in its tenant's serving
    generation, with a ``Searcher`` per generation (``configured``: the one of a database
    without generations, whose embedder also serves a generation of the default profile
    with the same model and dimension, so that a local model is not loaded twice)."""

    def __init__(
        self,
        pool: asyncpg.Pool[Any],
        settings: SearchSettings,
        configured: Embedder,
        embedder_for: EmbedderFactory,
        *,
        serving: ServingGenerations | None = None,
        rotation: ReplicaRotation | None = None,
    ) -> None:
        self._pool = pool
        self._rotation = rotation
        # Without replicas an `after` token is still checked against the primary's
        # position, so that a request is refused or answered alike on either set-up.
        self._primary_position = (
            rotation.primary
            if rotation is not None
            else PrimaryPosition(pool, timeout_seconds=settings.search_replica_check_seconds)
        )
        self._settings = settings
        self._configured = configured
        self._embedder_for = embedder_for
        self._serving = serving or ServingGenerations(pool, settings)
        # generation id (None: the configured model) -> its searcher; the generations a
        # process searches are the few an operator created, kept for its life.
        self._searchers: dict[int | None, Searcher] = {}
        # A generation this process cannot embed for stays so until it restarts with other
        # settings (the environment is read once per generation): failed once, answered so.
        self._unusable: dict[int, ConfigError] = {}
        self._indexes: list[PgSearchIndex] = []
        self._embedders: list[Embedder] = []  # opened here, closed by aclose

    def replica_views(self) -> list[ReplicaView]:
        """The read replicas and their lag (the operator page)."""
        return [] if self._rotation is None else self._rotation.views()

    async def search(self, request: SearchRequest) -> SearchResult:
        """Reads one server for the whole request: the one the replica rotation chose
        (services/search/replicas.py), else the pool this was built with. The server is
        chosen -- a token the primary never wrote refused, any wait for a replica done --
        before the request's fair-share slot is taken (search_slot): a search waiting for a
        replica holds no slot."""
        if self._rotation is None:
            if request.read_after is not None:
                await self._primary_position.check_written(
                    request.read_after, format_token(request.read_after)
                )
            async with search_slot():
                return await self._search(request)
        target = await self._rotation.choose(request.read_after)
        async with search_slot():
            try:
                with reading_from(target.pool):
                    result = await self._search(request)
            except (DatabaseUnavailable, DatabaseBusy, SerializationConflict) as error:
                if target.name == PRIMARY:
                    raise
                # The replica went away, or cancelled the search in a conflict with its
                # replay: the primary answers this one; the next check takes the replica out
                # if it stays so.
                log.warning("search.replica_failed", replica=target.name, error_code=error.code)
                SEARCH_READS.labels(server=PRIMARY).inc()
                result = await self._search(request)
                return replace(result, read_from=PRIMARY)
        return replace(result, read_from=target.name)

    async def _search(self, request: SearchRequest) -> SearchResult:
        started = time.perf_counter()
        generation = await self._serving.serving(request.tenant_id)
        result = await self._searcher(generation).search(request)
        if not result.results:
            now = await self._serving.serving(request.tenant_id)
            if _id(now) != _id(generation):
                log.info(
                    "search.generation_switched",
                    tenant_id=request.tenant_id,
                    generation_id=_id(generation),
                    serving_generation_id=_id(now),
                )
                result = await self._searcher(now).search(request)
        took_ms = round((time.perf_counter() - started) * 1000.0, 3)
        return replace(result, took_ms=took_ms)

    def _searcher(self, generation: SearchGeneration | None) -> Searcher:
        key = _id(generation)
        searcher = self._searchers.get(key)
        if searcher is None:
            if key is not None and key in self._unusable:
                raise self._unusable[key]
            # No await from the lookup to the insert: concurrent searches open it once.
            try:
                searcher = self._searchers[key] = self._open(generation)
            except ConfigError as error:
                if generation is not None:
                    log.error(
                        "search.generation_unusable",
                        generation_id=generation.generation_id,
                        provider_profile=generation.provider_profile,
                        error=error.message,
                    )
                    self._unusable[generation.generation_id] = error
                raise
        return searcher

    def _open(self, generation: SearchGeneration | None) -> Searcher:
        embedder = self._configured
        if generation is not None and not self._configured_serves(generation):
            embedder = self._embedder_for(generation)
            self._embedders.append(embedder)
            if (embedder.model, embedder.dimension) != (
                generation.embedding_model,
                generation.dimension,
            ):
                raise ConfigError(
                    f"{generation.describe()}: its profile embeds with {embedder.model} "
                    f"({embedder.dimension} dimensions)"
                )
        index = PgSearchIndex(
            self._pool,
            Generation(embedder.model, embedder.dimension, _id(generation)),
            self._settings,
        )
        self._indexes.append(index)
        log.info(
            "search.generation_opened",
            generation_id=_id(generation),
            provider_profile=generation.provider_profile if generation else None,
            embedding_model=embedder.model,
            dimension=embedder.dimension,
        )
        return Searcher(
            embedder,
            index,
            query_embed_timeout_seconds=self._settings.search_query_embed_timeout_seconds,
        )

    def _configured_serves(self, generation: SearchGeneration) -> bool:
        return generation.provider_profile == DEFAULT_PROFILE and (
            generation.embedding_model,
            generation.dimension,
        ) == (self._configured.model, self._configured.dimension)

    async def aclose(self) -> None:
        """Waits for what answered searches left running, then closes the embedders opened
        for generations (not the configured one: its owner closes it)."""
        for index in self._indexes:
            await index.ended()
        if self._rotation is None:
            await self._primary_position.aclose()
        for embedder in self._embedders:
            await embedder.aclose()
        self._searchers.clear()


def query_embedders(pool: asyncpg.Pool[Any], owner: str) -> EmbedderFactory:
    """A generation's query embedder: its profile's provider with its model and dimension
    (services.embedding.profiles), behind the provider's shared guard as the configured one
    (queries take their reserved share, an open breaker degrades hybrid to keywords)."""

    def build(generation: SearchGeneration) -> Embedder:
        from services.embedding.factory import build_embedder
        from services.embedding.guard.factory import guarded
        from services.embedding.guard.quota import Purpose
        from services.embedding.profiles import settings_for_generation

        settings = settings_for_generation(generation)
        inner = build_embedder(settings)
        embedder, _ = guarded(settings, inner, pool, purpose=Purpose.QUERY, owner=owner)
        return embedder

    return build


def _id(generation: SearchGeneration | None) -> int | None:
    return None if generation is None else generation.generation_id
