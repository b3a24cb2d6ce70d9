"""The provider's row in PostgreSQL is read three ways (guard.sql): one provider's view, the
row locked for a change, and every provider for the operator page and `kb tasks list`.
Each must read every column of it alike, so that no reader shows a state the others do not."""

from __future__ import annotations

import uuid
from dataclasses import astuple
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import pytest

from services.embedding.guard.breaker import BreakerPolicy, BreakerState
from services.embedding.guard.quota import QuotaPlan
from services.embedding.guard.store_pg import PgProviderStateStore
from services.runtime.indexing.index_failures import ErrorCode
from tests.support.clock import ManualClock

pytestmark = pytest.mark.integration

POLICY = BreakerPolicy(failure_threshold=2, open_seconds=30, max_open_seconds=100, probe_seconds=60)


async def test_the_view_the_list_and_a_locked_read_agree_on_every_column(
    pool: asyncpg.Pool[Any],
) -> None:
    clock = ManualClock(datetime.now(UTC).replace(microsecond=0))
    store = PgProviderStateStore(pool, clock=clock)
    provider = f"openai:https://api.test/v1#rows-{uuid.uuid4().hex[:6]}"
    # Every column set: a success, failures that open the breaker, a probe out, a pause.
    await store.record_success(provider)
    clock.advance(1)
    for _ in range(2):
        await store.record_failure(
            provider, code=ErrorCode.EMBEDDING_UNAVAILABLE, probe_owner=None, policy=POLICY
        )
    clock.advance(30)
    assert (await store.take_probe(provider, owner="a", policy=POLICY)).won
    await store.pause(provider, seconds=5, plan=QuotaPlan(requests_per_second=1.0))
    clock.advance(1)

    viewed = await store.view(provider)
    assert viewed.state is BreakerState.HALF_OPEN
    assert None not in astuple(viewed.breaker)
    assert (viewed.now, viewed.paused_until) == (clock.now(), clock.now() + timedelta(seconds=4))
    listed = {view.provider: view for view in await store.views()}
    assert listed[provider] == viewed
    # A probe another caller holds: the answer is the row as read under its lock.
    lost = await store.take_probe(provider, owner="b", policy=POLICY)
    assert not lost.won
    assert lost.view == viewed
