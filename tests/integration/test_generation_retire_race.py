"""`kb index generations retire` racing another remover of the same rows: a second retire
of the generation, run while the first is still deleting (or, for chunks, the collector or
a document erase)."""

from __future__ import annotations

from typing import Any

import asyncpg
import pytest

from services.indexer.generations.queries import QUERIES
from services.indexer.generations.retire import PgRetirement
from tests.support.generations import (
    NEW_MODEL,
    NEW_SETTINGS,
    add_document,
    build,
    new_generation,
    register_default,
)
from tests.support.locks import RowTaker

pytestmark = pytest.mark.integration

BATCH = 2
DOCUMENTS = 5
CHUNKS = 3


@pytest.mark.parametrize("step", ["chunks", "documents", "tasks"])
async def test_a_batch_whose_rows_another_retire_took_does_not_end_its_step(
    step: str, pool: asyncpg.Pool[Any], database_url: str
) -> None:
    """A second retire runs the next batch's statement first and commits while the first
    retire's batch waits on the same rows' locks: that batch removes none though more rows
    are left. The step goes on until a batch finds nothing left, so nothing of the
    generation stays behind a generation marked RETIRED."""
    await register_default(pool)
    docs = [await add_document(pool, "acme") for _ in range(DOCUMENTS)]
    g = await new_generation(pool, ["acme"])
    for doc in docs:
        await build(pool, doc, g, chunks=CHUNKS)
    statement, args = {
        "chunks": ("delete_chunk_batch", ("acme", NEW_MODEL, NEW_SETTINGS, BATCH)),
        "documents": ("delete_document_versions_batch", (g, BATCH)),
        "tasks": ("delete_task_batch", (g, BATCH)),
    }[step]
    async with RowTaker(database_url) as taker:

        async def between(name: str) -> None:
            if name != step or taker.took:
                return
            # The same statement with the same arguments on the same rows picks the rows
            # the first retire's next batch picks; deleted and not yet committed, that
            # batch's snapshot still holds them and it waits on their row locks.
            taken = await taker.take(QUERIES[statement], *args)
            assert taken is not None
            assert (taken["removed"], taken["seen"]) == (BATCH, BATCH)

        outcome = await PgRetirement(pool, batch_size=BATCH, between_batches=between).retire(g)
        await taker.committed()

    left = {
        "chunks": await pool.fetchval(
            "SELECT count(*) FROM knowledge_chunk WHERE embedding_model = $1", NEW_MODEL
        ),
        "documents": await pool.fetchval(
            "SELECT count(*) FROM document_generation_version WHERE generation_id = $1", g
        ),
        "tasks": await pool.fetchval("SELECT count(*) FROM index_task WHERE generation_id = $1", g),
    }
    assert left == {"chunks": 0, "documents": 0, "tasks": 0}
    assert await pool.fetchval(
        "SELECT state FROM search_generation WHERE generation_id = $1", g
    ) == ("RETIRED")
    # What this retire removed itself: the second took one batch of the raced step.
    removed = {
        "chunks": outcome.chunks_deleted,
        "documents": outcome.document_rows_deleted,
        "tasks": outcome.tasks_deleted,
    }
    expected = {"chunks": DOCUMENTS * CHUNKS, "documents": DOCUMENTS, "tasks": DOCUMENTS}
    expected[step] -= BATCH
    assert removed == expected
