"""Serving the publisher app with uvicorn: the server's own limits and a graceful SIGTERM.

``kb serve`` is :func:`serve_app` on :func:`services.publisher.web.api.create_app`; a composed
app (publisher plus other routes) is served the same way.
"""

from __future__ import annotations

import asyncio
import signal
from types import FrameType
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from services.publisher.settings import PublisherSettings


def uvicorn_options(settings: PublisherSettings) -> dict[str, Any]:
    """The server-level limits: uvicorn's 503 beyond ``limit_concurrency`` connections and
    tasks (a backstop behind the upload budget), idle keep-alive connections closed, request
    heads bounded in size (h11) and in time (:func:`head_timeout_protocol`)."""
    return {
        "http": head_timeout_protocol(settings.publisher_request_head_timeout_seconds),
        "limit_concurrency": settings.publisher_limit_concurrency,
        "timeout_keep_alive": settings.publisher_keep_alive_seconds,
        "h11_max_incomplete_event_size": settings.publisher_max_header_bytes,
        "log_level": settings.log_level,
        "access_log": False,
        "lifespan": "on",
        # uvicorn's own startup/shutdown lines go to stderr like every log of ours.
        "log_config": None,
    }


def serve_app(app: Any, *, host: str, port: int, settings: PublisherSettings) -> None:
    config = uvicorn.Config(app, host=host, port=port, **uvicorn_options(settings))
    GracefulServer(config).run()


def head_timeout_protocol(seconds: float) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol, closing a connection whose request head (request line and
    headers) is not complete ``seconds`` after the connection opened or the previous answer
    ended. uvicorn has no such timeout of its own: a client sending a byte now and then
    would otherwise hold its connection (and its slot of ``limit_concurrency``) forever."""

    class HeadTimeoutH11Protocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)  # type: ignore[arg-type]
            self._arm_head_timer()

        def data_received(self, data: bytes) -> None:
            cycle = self.cycle
            super().data_received(data)
            if self.cycle is not cycle:  # a request head arrived
                self._disarm_head_timer()

        def on_response_complete(self) -> None:
            cycle = self.cycle
            super().on_response_complete()
            if self.cycle is cycle and not self.transport.is_closing():
                self._arm_head_timer()  # waiting for the next request's head

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_head_timer()
            super().connection_lost(exc)

        def _arm_head_timer(self) -> None:
            self._disarm_head_timer()
            self._head_timer = self.loop.call_later(seconds, self._head_timed_out)

        def _disarm_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if not self.transport.is_closing():
                self.transport.close()

    return HeadTimeoutH11Protocol


class GracefulServer(uvicorn.Server):
    """SIGTERM is how orchestrators stop a service: a graceful stop is a success and exits
    0. uvicorn by default re-raises the signal after shutting down (exit -15), which
    supervisors report as a crash."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        if sig == signal.SIGTERM and sig in self._captured_signals:
            self._captured_signals.remove(sig)
