"""A bad setting of the offline model's runs stops `kb indexer run-once` with exit 2, a
message naming the variables, and no task claimed."""

from __future__ import annotations

from typing import Any

import asyncpg
import pytest

from tests.support.cli import kb
from tests.support.tasks import create_task

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    ("variables", "said"),
    [
        ({"KB_EMBEDDING_RUNS_PER_REQUEST": "0"}, "KB_EMBEDDING_RUNS_PER_REQUEST"),
        (
            {
                "KB_EMBEDDING_INTRA_OP_THREADS": "64",
                "KB_EMBEDDING_RUNS_PER_REQUEST": "8",
            },
            "512 model threads at once",
        ),
    ],
)
async def test_a_bad_runs_setting_exits_2_and_claims_nothing(
    pool: asyncpg.Pool[Any],
    service_env: dict[str, str],
    variables: dict[str, str],
    said: str,
) -> None:
    await create_task(pool)
    done = kb(service_env | variables, "indexer", "run-once", "--tier", "standard")
    assert done.returncode == 2, done.stderr
    assert said in done.stderr
    assert "[CONFIG_INVALID]" in done.stderr
    assert done.stdout.strip() == "FAILED"
    assert await pool.fetchval("SELECT status FROM index_task") == "PENDING"
