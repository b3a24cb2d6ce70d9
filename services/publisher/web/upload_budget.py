"""A process-wide budget of upload bytes in flight.

An upload is read whole (up to the file limit) and may then wait for a database connection:
without a bound, many parallel uploads hold many copies of their files at once. Each upload
reserves its declared size (or the request limit, when it declares none) before its body is
read; when the budget cannot cover it, it is answered 503 with Retry-After, its body never
held, and the client retries later.

A client that sent ``Expect: 100-continue`` never sends the body of a refused upload. Any
other client is already sending it: the body is read and dropped chunk by chunk before the
answer, because a server that closes a connection with unread data in it resets it (TCP RST),
and the client may then lose the answer itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from starlette.types import Receive, Scope, Send

from services.publisher.web.body_limit import declared_length, is_upload
from services.publisher.web.middleware import HttpMiddleware
from services.runtime.web.http_problem import refuse_unread

BUSY_CODE: Final = "UPLOADS_BUSY"


class UploadBudget:
    """Bytes reserved by uploads in flight (one event loop: no lock needed)."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.in_use_bytes = 0

    def try_reserve(self, size: int) -> bool:
        # One upload is always admitted when nothing else is in flight, however large: a
        # budget below the request limit must not refuse everything.
        if self.in_use_bytes and self.in_use_bytes + size > self.capacity_bytes:
            return False
        self.in_use_bytes += size
        return True

    def release(self, size: int) -> None:
        self.in_use_bytes -= size


@dataclass(eq=False, kw_only=True)
class UploadBudgetMiddleware(HttpMiddleware):
    budget: UploadBudget
    max_request_bytes: int
    retry_after_seconds: int

    def applies(self, scope: Scope) -> bool:
        return is_upload(scope)

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        declared = declared_length(scope)
        size = self.max_request_bytes
        if declared is not None and declared >= 0:
            size = min(declared, size)
        if not self.budget.try_reserve(size):
            await refuse_unread(
                scope,
                receive,
                send,
                status=503,
                code=BUSY_CODE,
                message="too many uploads are in progress; retry after the time in Retry-After",
                retry_after_seconds=self.retry_after_seconds,
            )
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.budget.release(size)
