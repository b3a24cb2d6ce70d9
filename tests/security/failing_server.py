"""FOR LOG TESTS ONLY: ``python -m tests.security.failing_server --port P`` is `kb serve`
(the same settings, logging, app and uvicorn configuration) plus routes that fail the ways
code can fail, each with the caller's credentials in its frame's locals, as every route of
the API has them:

- ``GET  .../test-only/raise``: an unhandled exception whose message carries the key;
- ``GET  .../test-only/task``: a background task fails and nobody retrieves its exception
  (asyncio logs "Task exception was never retrieved");
- ``GET  .../test-only/after-response``: a Starlette background task fails after the answer;
- ``POST .../test-only/close-pool``: the publisher's database pool is closed, so that every
  later request that needs it (the key check included) fails.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
from typing import Annotated

from fastapi import APIRouter, FastAPI, Request, Security
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials
from starlette.background import BackgroundTask

from services.publisher.web.routes import bearer

router = APIRouter(prefix="/v1/tenants/{tenantId}/test-only")
# Every route of the API has the caller's credentials in a frame's locals: so have these.
Credentials = Annotated[HTTPAuthorizationCredentials, Security(bearer)]


class InjectedFailure(RuntimeError):
    pass


@router.get("/raise")
async def raise_with_the_key(
    credentials: Credentials,
) -> None:
    key = credentials.credentials
    raise InjectedFailure(f"could not use the key {key} (injected)")


async def _fail_with(key: str) -> None:
    raise InjectedFailure(f"background work with {key} failed (injected)")


@router.get("/task")
async def fail_in_a_task(
    credentials: Credentials,
) -> dict[str, bool]:
    task = asyncio.create_task(_fail_with(credentials.credentials))
    await asyncio.wait([task])
    # Nobody retrieves the exception: asyncio logs it when the task is collected.
    del task
    gc.collect()
    return {"ok": True}


@router.get("/after-response")
async def fail_after_the_answer(
    credentials: Credentials,
) -> JSONResponse:
    return JSONResponse(
        {"ok": True}, background=BackgroundTask(_fail_with, credentials.credentials)
    )


@router.post("/close-pool")
async def close_the_pool(request: Request, credentials: Credentials) -> dict[str, bool]:
    request.app.state.store.pool.terminate()
    return {"closed": True}


def failing_app(app: FastAPI) -> FastAPI:
    app.include_router(router)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()

    from services.app import create_app
    from services.publisher.settings import PublisherSettings
    from services.publisher.web.server import GracefulServer
    from services.runtime.commands.cli_support import load_settings
    from services.runtime.logging import configure_logging
    from services.runtime.web.http_strict import HttpSettings
    from services.serve import server_config

    settings = load_settings(PublisherSettings)
    configure_logging(settings.log_level, settings.log_format, service="kb-api")
    config = server_config(
        failing_app(create_app(settings)),
        host="127.0.0.1",
        port=args.port,
        settings=settings,
        http=load_settings(HttpSettings),
    )
    GracefulServer(config).run()


if __name__ == "__main__":
    main()
