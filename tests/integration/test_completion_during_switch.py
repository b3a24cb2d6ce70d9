"""A completion that starts while `kb index generations switch` holds the tenant's rows must
see the switch's outcome once it commits (found by `kb chaos run --seed 20261204`).

The completion's lock used to read the serving row `WHERE serving ... FOR SHARE`: after
waiting for the switch, READ COMMITTED re-checks only the row it had found (the old serving
one, no longer serving) and never sees the new serving row, so the completion took the
default generation for the serving one. A task of the new generation then moved no pointer,
and the switch had already copied the pointers: search stayed on the older version."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
import pytest

from services.indexer.generations.queries import QUERIES as SWITCH_QUERIES
from services.indexer.sink.generations import QUERIES as SINK_QUERIES
from tests.support.api import add_tenant
from tests.support.locks import wait_until_blocked_on_a_lock

pytestmark = pytest.mark.integration


async def _generation(conn: asyncpg.Connection[Any], model: str, default: bool) -> int:
    generation: int = await conn.fetchval(
        "INSERT INTO search_generation (provider_profile, embedding_model, dimension, "
        "chunk_max_tokens, chunk_overlap_tokens, is_default) "
        "VALUES ('default', $1, 8, 64, 0, $2) RETURNING generation_id",
        model,
        default,
    )
    return generation


async def test_a_completion_waiting_on_a_switch_sees_the_new_serving_generation(
    pool: asyncpg.Pool[Any], conn: asyncpg.Connection[Any]
) -> None:
    tenant = (await add_tenant(conn)).tenant_id
    old = await _generation(conn, "hashing-v1-8", default=True)
    new = await _generation(conn, "hashing-v1-9", default=False)
    await conn.execute(
        "INSERT INTO tenant_search_generation (tenant_id, generation_id, serving) "
        "VALUES ($1, $2, true), ($1, $3, false)",
        tenant,
        old,
        new,
    )
    async with pool.acquire() as switch, pool.acquire() as completion:
        switching = switch.transaction()
        await switching.start()
        await switch.fetch(SWITCH_QUERIES["lock_tenant_generations"], tenant)
        await switch.execute(SWITCH_QUERIES["stop_serving"], tenant)
        await switch.execute(SWITCH_QUERIES["start_serving"], tenant, new, None)

        async def complete() -> Any:
            async with completion.transaction():
                return await completion.fetchrow(
                    SINK_QUERIES["lock_completion_generation"], [tenant], [new], [True]
                )

        completing = asyncio.create_task(complete())
        await wait_until_blocked_on_a_lock(conn)
        await switching.commit()
        row = await completing
    assert row["serving"] == new
    assert row["state"] == "ACTIVE"
