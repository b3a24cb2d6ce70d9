"""How the indexer builds a search generation's pipeline when a task of it first arrives
(pipeline/generations.py): the embedder of its provider profile with its model and dimension
(services.embedding.profiles), guarded as the default's is for a remote provider, its
chunking, its model's index generation (and, with KB_INDEXER_PARTITION_GRAPHS on, the
model's partitioned ANN index), and its chunking settings recorded.
"""

from __future__ import annotations

from typing import Any

import asyncpg

from services.embedding.factory import build_embedder
from services.embedding.guard.factory import guarded
from services.embedding.guard.quota import Purpose
from services.embedding.profiles import settings_for_generation
from services.index.generations import SearchGeneration
from services.indexer.pipeline.generations import (
    BuildPipeline,
    BuiltPipeline,
    GenerationPipeline,
    batching_of,
    tenant_share_of,
)
from services.indexer.pipeline.version_indexer import chunking_strategy
from services.indexer.sink.generations import record_chunking_settings
from services.indexer.sink.pgvector import PgVectorSink


def pipeline_builder(pool: asyncpg.Pool[Any], sink: PgVectorSink, *, owner: str) -> BuildPipeline:
    """``build(generation)`` for ``GenerationPipelines``: the pipeline, its embedder warmed
    up, and what closes it."""

    async def build(search: SearchGeneration) -> BuiltPipeline:
        embedding = settings_for_generation(search)
        embedder = build_embedder(embedding)
        try:
            requests, guard = guarded(embedding, embedder, pool, purpose=Purpose.INDEX, owner=owner)
            warm_up = getattr(embedder, "warm_up", None)
            if warm_up is not None:
                await warm_up()
            pipeline = GenerationPipeline(
                requests,
                sink,
                strategy=chunking_strategy(
                    embedder,
                    max_tokens=search.chunk_max_tokens,
                    overlap_tokens=search.chunk_overlap_tokens,
                ),
                batching=batching_of(embedding),
                tenant_share=tenant_share_of(guard, embedding),
                search=search,
            )
            await sink.ensure_generation(pipeline.generation)
            await record_chunking_settings(pool, search, pipeline.generation)
        except BaseException:
            await embedder.aclose()
            raise
        return pipeline, embedder.aclose

    return build
