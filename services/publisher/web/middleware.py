"""What the publisher's pure ASGI middlewares have in common: they act on HTTP requests
only, and take their settings as keywords after the app they wrap."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.types import ASGIApp, Receive, Scope, Send


@dataclass(eq=False)
class HttpMiddleware:
    """``handle`` sees each HTTP request ``applies`` to; every other request, and every
    other scope (lifespan), goes straight on to ``app``. A subclass is a dataclass whose
    fields are its settings (keyword-only)."""

    app: ASGIApp

    def applies(self, scope: Scope) -> bool:
        return True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.applies(scope):
            await self.app(scope, receive, send)
            return
        await self.handle(scope, receive, send)

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        raise NotImplementedError
