"""services.indexer.pipeline.generations: each task gets its generation's pipeline; the
default's without building anything, another's built once however many of its tasks arrive
at once, a failed build tried again by the next task, a retiring generation's tasks none."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest

from services.embedding.batching import Batching
from services.embedding.hashing import HashingEmbedder
from services.index.generations import GenerationState, SearchGeneration
from services.indexer.pipeline.generations import (
    BoundSink,
    BuiltPipeline,
    GenerationPipeline,
    GenerationPipelines,
)
from services.indexer.pipeline.version_indexer import chunking_strategy
from services.indexer.task import ErrorCode, IndexingFailed, Lease
from services.runtime.errors import ConfigError


def generation(generation_id: int, state: GenerationState = "ACTIVE") -> SearchGeneration:
    return SearchGeneration(
        generation_id=generation_id,
        provider_profile="default",
        embedding_model=f"hashing-v1-{8 * generation_id}",
        dimension=8 * generation_id,
        chunk_max_tokens=64,
        chunk_overlap_tokens=0,
        chunking_settings=None,
        is_default=generation_id == 1,
        state=state,
    )


def pipeline(search: SearchGeneration) -> GenerationPipeline:
    embedder = HashingEmbedder(dimension=search.dimension)
    return GenerationPipeline(
        embedder,
        object(),  # type: ignore[arg-type]  # never written to here
        strategy=chunking_strategy(embedder, max_tokens=search.chunk_max_tokens),
        batching=Batching(batch_size=8),
        search=search,
    )


def lease(generation_id: int | None) -> Lease:
    return Lease(
        task_id=uuid.uuid4(),
        owner="w1",
        lease_attempt=1,
        lease_until=datetime(2030, 1, 1, tzinfo=UTC),
        tenant_id="acme",
        document_id=uuid.uuid4(),
        version_number=1,
        task_type="INDEX_VERSION",
        tier="standard",
        max_attempts=8,
        generation_id=generation_id,
    )


class Builds:
    """A builder that counts its builds, fails while told to, and waits for a release."""

    def __init__(self) -> None:
        self.built: list[int] = []
        self.closed: list[int] = []
        self.failing = False
        self.release = asyncio.Event()
        self.release.set()

    async def __call__(self, search: SearchGeneration) -> BuiltPipeline:
        await self.release.wait()
        if self.failing:
            raise ConfigError("no such profile")
        self.built.append(search.generation_id)

        async def close() -> None:
            self.closed.append(search.generation_id)

        return pipeline(search), close


def pipelines(
    generations: dict[int, SearchGeneration],
    builds: Builds,
    looked_up: tuple[int, asyncio.Event] | None = None,
) -> GenerationPipelines:
    """``looked_up``: an event set once that many tasks have asked for their generation."""
    default = pipeline(generations[1])
    asked = 0

    async def look_up(task: Lease) -> SearchGeneration | None:
        nonlocal asked
        asked += 1
        if looked_up is not None and asked == looked_up[0]:
            looked_up[1].set()
        return generations[task.generation_id or 1]

    return GenerationPipelines(default, look_up, builds)


async def test_the_default_generation_is_never_built_again() -> None:
    builds = Builds()
    found = pipelines({1: generation(1)}, builds)
    assert await found.pipeline_for(lease(None)) is found.default
    assert await found.pipeline_for(lease(1)) is found.default
    assert builds.built == []


async def test_another_generation_is_built_once_for_tasks_arriving_together() -> None:
    builds = Builds()
    builds.release.clear()  # the build waits until every task has asked for it
    everyone = asyncio.Event()
    found = pipelines({1: generation(1), 2: generation(2)}, builds, (3, everyone))
    waiting = [asyncio.create_task(found.pipeline_for(lease(2))) for _ in range(3)]
    await everyone.wait()
    builds.release.set()
    got = await asyncio.gather(*waiting)
    assert builds.built == [2]
    assert got[0] is got[1] is got[2]
    assert got[0] is not None
    assert got[0].generation.embedding_model == "hashing-v1-16"
    assert isinstance(got[0].sink, BoundSink)
    assert await found.pipeline_for(lease(2)) is got[0]
    await found.aclose()
    assert builds.closed == [2]


async def test_a_failed_build_fails_the_task_retriably_and_is_tried_again() -> None:
    builds = Builds()
    builds.failing = True
    found = pipelines({1: generation(1), 2: generation(2)}, builds)
    with pytest.raises(IndexingFailed) as failed:
        await found.pipeline_for(lease(2))
    assert failed.value.code == ErrorCode.EMBEDDING_UNAVAILABLE
    assert failed.value.retriable
    builds.failing = False
    assert await found.pipeline_for(lease(2)) is not None
    assert builds.built == [2]


async def test_a_retiring_generations_tasks_get_no_pipeline() -> None:
    builds = Builds()
    found = pipelines({1: generation(1), 2: generation(2, "RETIRING")}, builds)
    assert await found.pipeline_for(lease(2)) is None
    assert builds.built == []


def test_a_pipeline_names_what_it_builds() -> None:
    built: Any = pipeline(generation(3))
    assert built.generation.dimension == 24
    assert built.batch_size == 8
