"""The chaos run's "pointer at newest indexed version" (kbtools/chaos/checks/converge.py)
counts only the tasks of the pointer's own generation. Two generations of one model that
differ in their chunk settings: a version the other generation built (a backfill beside the
served one) is not one the pointer should be at; a newer version its own generation built
still is."""

from __future__ import annotations

import uuid
from typing import Any

import asyncpg
import pytest

from kbtools.chaos.checks.converge import check_pointers
from kbtools.chaos.checks.queries import QUERIES
from kbtools.chaos.checks.result import CheckResult
from tests.support.generations import OLD_MODEL, Doc, add_document, register_default

pytestmark = pytest.mark.integration

SMALLER_CHUNKS = "heading-semchunk-v1:max=200:overlap=0:tok=approx"
INVARIANT = "pointer at newest indexed version"


async def _beside(pool: asyncpg.Pool[Any]) -> int:
    """A generation of the served model with other chunk settings, built beside it."""
    generation_id: int = await pool.fetchval(
        """
        INSERT INTO search_generation (provider_profile, embedding_model, dimension,
                                       chunk_max_tokens, chunk_overlap_tokens,
                                       chunking_settings)
        VALUES ('default', $1, 3, 200, 0, $2)
        RETURNING generation_id
        """,
        OLD_MODEL,
        SMALLER_CHUNKS,
    )
    return generation_id


async def _succeeded(
    pool: asyncpg.Pool[Any], doc: Doc, version: int, generation: int | None
) -> None:
    await pool.execute(
        """
        INSERT INTO index_task (task_id, tenant_id, document_id, version_number, tier,
                                generation_id, status, finished_at)
        VALUES ($1, $2, $3, $4, 'standard', $5, 'SUCCEEDED', now())
        """,
        uuid.uuid4(),
        doc.tenant_id,
        doc.document_id,
        version,
        generation,
    )


async def _judged(conn: asyncpg.Connection[Any]) -> tuple[list[str], int]:
    result = CheckResult()
    await check_pointers(conn, result)
    not_current = int(await conn.fetchval(QUERIES["not_current"]))
    return list(result.evidence[INVARIANT]), not_current


async def test_only_the_pointers_own_generation_counts(
    pool: asyncpg.Pool[Any], conn: asyncpg.Connection[Any]
) -> None:
    served_generation = await register_default(pool)
    other_generation = await _beside(pool)
    # Served at v1 by the default generation; v2 built only in the other one.
    doc = await add_document(pool, "acme", served=1, published=2)
    await _succeeded(pool, doc, 1, None)
    await _succeeded(pool, doc, 2, other_generation)
    assert await _judged(conn) == ([], 0)

    # v2 built in the pointer's own generation too: the pointer lags, and both say so.
    await _succeeded(pool, doc, 2, served_generation)
    violations, not_current = await _judged(conn)
    assert not_current == 1
    assert violations == [f"acme/{doc.document_id}: serves v1 ({OLD_MODEL}), newest indexed v2"]
