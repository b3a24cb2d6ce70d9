"""Request bodies: bounded in size (413) and in how long they may stall (408).

Uploads (``multipart/form-data``) may be as large as a file plus its framing; every other
body (publish's JSON) only a few KiB. A declared ``Content-Length`` above the limit is
refused before anything is read; an undeclared (chunked) body is counted while it streams.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Message, Receive, Scope, Send

from services.publisher.web.middleware import HttpMiddleware
from services.runtime.web.http_problem import problem_response


def is_upload(scope: Scope) -> bool:
    for name, value in scope["headers"]:
        if name.lower() == b"content-type":
            return bytes(value).lower().startswith(b"multipart/form-data")
    return False


def declared_length(scope: Scope) -> int | None:
    """The request's Content-Length; ``None`` when absent, -1 when unreadable."""
    for name, value in scope["headers"]:
        if name.lower() == b"content-length":
            try:
                declared = int(value)
            except ValueError:
                return -1
            return declared if declared >= 0 else -1
    return None


@dataclass(eq=False, kw_only=True)
class BodyLimitMiddleware(HttpMiddleware):
    max_upload_bytes: int
    max_other_bytes: int
    read_timeout_seconds: float

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit = self.max_upload_bytes if is_upload(scope) else self.max_other_bytes
        declared = declared_length(scope)
        if declared == -1:
            await problem_response(
                400, "BAD_REQUEST", "invalid Content-Length", instance=scope["path"]
            )(scope, receive, send)
            return
        if declared is not None and declared > limit:
            await problem_response(
                413, "PAYLOAD_TOO_LARGE", _too_large(limit), instance=scope["path"]
            )(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            try:
                async with asyncio.timeout(self.read_timeout_seconds):
                    message = await receive()
            except TimeoutError:
                # A client that stops sending must not hold its slot of the upload budget.
                raise StarletteHTTPException(
                    408, f"no request body bytes for {self.read_timeout_seconds:g} s"
                ) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    # FastAPI re-raises an HTTPException met while reading the body; the
                    # problem handler turns it into the 413 answer.
                    raise StarletteHTTPException(413, _too_large(limit))
            return message

        await self.app(scope, limited_receive, send)


def _too_large(limit: int) -> str:
    return f"the request body is larger than {limit} bytes"
