"""Serving the publisher app with uvicorn: the server's own limits and a graceful SIGTERM.

``kb serve`` is :func:`serve_app` on :func:`services.publisher.api.create_app`; a composed
app (publisher plus other routes) is served the same way.
"""

from __future__ import annotations

import signal
from types import FrameType
from typing import Any

import uvicorn

from services.publisher.settings import PublisherSettings


def uvicorn_options(settings: PublisherSettings) -> dict[str, Any]:
    """The server-level limits: uvicorn's 503 beyond ``limit_concurrency`` connections and
    tasks (a backstop behind the upload budget), idle keep-alive connections closed, request
    heads bounded (h11)."""
    return {
        "http": "h11",
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


class GracefulServer(uvicorn.Server):
    """SIGTERM is how orchestrators stop a service: a graceful stop is a success and exits
    0. uvicorn by default re-raises the signal after shutting down (exit -15), which
    supervisors report as a crash."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        if sig == signal.SIGTERM and sig in self._captured_signals:
            self._captured_signals.remove(sig)
