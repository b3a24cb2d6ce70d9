"""The operator page for tests: an in-process app over a real database, and signing in."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
import httpx
from fastapi import FastAPI

from services.operator.context import build_operator_context
from services.operator.routes import mount_operator
from services.operator.settings import OperatorSettings

OPERATOR_TOKEN = "operator-test-token-0123456789-abcdef"
# HTTPS: the session cookie is Secure by default, and a client sends it back over HTTPS only.
BASE_URL = "https://operator.test"
_HIDDEN = re.compile(r'name="(?P<name>login_token|csrf)" value="(?P<value>[^"]+)"')


def operator_settings(database_url: str, **overrides: Any) -> OperatorSettings:
    return OperatorSettings.model_validate(
        {"database_url": database_url, "operator_token": OPERATOR_TOKEN, **overrides}
    )


@asynccontextmanager
async def operator_client(
    pool: asyncpg.Pool[Any], settings: OperatorSettings
) -> AsyncIterator[httpx.AsyncClient]:
    app = FastAPI()
    mount_operator(app, build_operator_context(pool, settings))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url=BASE_URL) as client:
        yield client


def hidden(html: str, name: str) -> str:
    for match in _HIDDEN.finditer(html):
        if match["name"] == name:
            return match["value"]
    raise AssertionError(f"no hidden field {name!r} in the page")


async def sign_in(client: httpx.AsyncClient, token: str = OPERATOR_TOKEN) -> httpx.Response:
    form = await client.get("/ui/login")
    return await client.post(
        "/ui/login", data={"token": token, "login_token": hidden(form.text, "login_token")}
    )


async def tier_counts(db: asyncpg.Pool[Any] | asyncpg.Connection[Any], tier: str) -> dict[str, int]:
    """What the operator page's tier card should say, counted straight from the queue:
    tasks due now, running, dead."""
    row = await db.fetchrow(
        """SELECT count(*) FILTER (WHERE status IN ('PENDING', 'RETRY_WAIT')
                                   AND next_attempt_at <= now()) AS due,
                  count(*) FILTER (WHERE status = 'RUNNING') AS running,
                  count(*) FILTER (WHERE status = 'DEAD') AS dead
             FROM index_task WHERE tier = $1""",
        tier,
    )
    assert row is not None
    return dict(row)
