from __future__ import annotations

import uuid
from typing import Any

import asyncpg
import pytest

from services.runtime.outbox import OutboxEvent, add_event, aggregate_key


def _event() -> OutboxEvent:
    return OutboxEvent(
        event_type="Probe",
        tenant_id="acme",
        tier="standard",
        aggregate_key=aggregate_key("acme", uuid.uuid4()),
        payload=b"\xc3\x01body",
    )


async def test_event_commits_with_the_callers_transaction(conn: asyncpg.Connection[Any]) -> None:
    event = _event()
    async with conn.transaction():
        stored = await add_event(conn, event)
    row = await conn.fetchrow("SELECT * FROM outbox WHERE position = $1", stored.position)
    assert row is not None
    assert row["event_id"] == event.event_id
    assert row["payload"] == event.payload
    assert row["txid"] is not None


async def test_event_rolls_back_with_the_callers_transaction(
    conn: asyncpg.Connection[Any],
) -> None:
    class Boom(Exception):
        pass

    with pytest.raises(Boom):
        async with conn.transaction():
            await add_event(conn, _event())
            raise Boom
    assert await conn.fetchval("SELECT count(*) FROM outbox") == 0


async def test_outside_a_transaction_is_a_programming_error(
    conn: asyncpg.Connection[Any],
) -> None:
    with pytest.raises(RuntimeError, match="inside the producer's transaction"):
        await add_event(conn, _event())
    assert await conn.fetchval("SELECT count(*) FROM outbox") == 0
