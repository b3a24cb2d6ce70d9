"""The operator page's "Index generations" card: per generation its progress (a bar of done
out of done + pending + failed), state and the tenants it serves, as
`kb index generations status` counts them."""

from __future__ import annotations

import re
from typing import Any

import asyncpg
import pytest

from tests.support.generations import add_document, build, new_generation, register_default
from tests.support.operator import operator_client, operator_settings, sign_in

pytestmark = pytest.mark.integration


def generation_row(html: str, generation_id: int) -> str:
    row = re.search(rf'<tr data-generation="{generation_id}">(.*?)</tr>', html, re.S)
    assert row is not None, f"no row for generation {generation_id}"
    return row.group(1)


def metric(row: str, name: str) -> str:
    found = re.search(rf'data-metric="{name}"[^>]*>(.*?)</td>', row, re.S)
    assert found is not None, f"no {name}"
    return re.sub(r"<[^>]+>", "", found.group(1)).strip()


async def test_the_card_shows_each_generations_progress_and_serving_tenants(
    pool: asyncpg.Pool[Any], database_url: str
) -> None:
    default = await register_default(pool)
    docs = [await add_document(pool, "acme") for _ in range(4)]
    await add_document(pool, "beta")
    g = await new_generation(pool, ["acme"])
    for doc in docs[:3]:
        await build(pool, doc, g)
    await pool.execute(
        "UPDATE index_task SET status = 'DEAD', finished_at = now(), error_code = 'X'"
        " WHERE generation_id = $1 AND document_id = $2",
        g,
        docs[3].document_id,
    )

    async with operator_client(pool, operator_settings(database_url)) as client:
        await sign_in(client)
        html = (await client.get("/ui")).text

    new = generation_row(html, g)
    # Three done; the fourth's task is DEAD (the three others' tasks are still PENDING here:
    # a completion simulated by hand does not finish them).
    assert metric(new, "progress") == "3 / 3 / 1"
    assert '<progress value="3" max="7">' in new
    assert metric(new, "percent") == "43%"
    assert metric(new, "chunks") == "9"
    assert metric(new, "serving") == "0"
    assert metric(new, "state") == "ACTIVE"
    old = generation_row(html, default)
    assert "(default)" in old
    assert metric(old, "serving") == "2 (acme, beta)"
    assert metric(old, "progress") == "4 / 0 / 0"


async def test_the_card_says_when_there_is_no_generation(
    pool: asyncpg.Pool[Any], database_url: str
) -> None:
    async with operator_client(pool, operator_settings(database_url)) as client:
        await sign_in(client)
        html = (await client.get("/ui")).text
    assert "No generation registered yet" in html
