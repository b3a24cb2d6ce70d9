"""Where an operator sees the embedding provider's shared breaker: a line of `kb tasks list`
(on stderr, so its stdout stays one line per task) and a row of the operator page."""

from __future__ import annotations

import os
import re
from typing import Any

import asyncpg
import pytest

from services.embedding.guard.breaker import BreakerPolicy
from services.embedding.guard.store_pg import PgProviderStateStore
from services.operator.auth import digest, new_operator_key
from services.operator.store_pg import PgOperatorStore
from services.runtime.indexing.index_failures import ErrorCode
from tests.support.cli import kb
from tests.support.operator import operator_client, operator_settings, sign_in
from tests.support.tasks import create_task

pytestmark = pytest.mark.integration

PROVIDER = "openai:http://provider.test/v1#shown-model"


async def open_breaker(pool: asyncpg.Pool[Any]) -> None:
    store = PgProviderStateStore(pool)
    policy = BreakerPolicy(failure_threshold=2, open_seconds=600, max_open_seconds=600)
    for _ in range(2):
        await store.record_failure(
            PROVIDER, code=ErrorCode.EMBEDDING_UNAVAILABLE, probe_owner=None, policy=policy
        )


async def test_kb_tasks_list_names_an_open_breaker(
    pool: asyncpg.Pool[Any], database_url: str
) -> None:
    task = await create_task(pool, tenant_id="acme")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KB_")}
    env["DATABASE_URL"] = database_url
    closed = kb(env, "tasks", "list")
    assert closed.returncode == 0, closed.stderr
    assert "embedding provider" not in closed.stderr

    await open_breaker(pool)
    listed = kb(env, "tasks", "list")
    assert listed.returncode == 0, listed.stderr
    line = next(x for x in listed.stderr.splitlines() if x.startswith("# embedding provider"))
    assert PROVIDER in line
    assert re.search(r"breaker OPEN, next probe in \d+ s, 2 failures in a row", line), line
    assert "EMBEDDING_UNAVAILABLE" in line
    # stdout is still one line per task.
    assert [row.split()[0] for row in listed.stdout.splitlines()] == [str(task.task_id)]


async def test_the_operator_page_shows_the_breaker(
    pool: asyncpg.Pool[Any], database_url: str
) -> None:
    key = new_operator_key()
    await PgOperatorStore(pool).create_operator_key("alice", digest(key))
    async with operator_client(pool, operator_settings(database_url)) as client:
        await sign_in(client, key)
        before = (await client.get("/ui")).text
        assert "No remote embedding provider" in before
        await open_breaker(pool)
        after = (await client.get("/ui")).text
    row = re.search(rf'<tr data-provider="{re.escape(PROVIDER)}">(.*?)</tr>', after, re.S)
    assert row is not None, after
    assert 'data-metric="breaker" class="bad">open<' in row.group(1)
    assert "2 failures in a row" in row.group(1)
