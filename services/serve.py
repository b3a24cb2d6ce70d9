"""`kb serve`: the HTTP API (services/app.py: the publisher's routes and search)."""

from __future__ import annotations

import signal
from types import FrameType
from typing import Any

import typer

from services.publisher.settings import PublisherSettings
from services.runtime.logging import configure_logging


def serve(
    host: str = typer.Option("127.0.0.1", "--host", help="Interface to listen on."),
    port: int = typer.Option(8080, "--port", min=0, max=65535, help="TCP port."),
) -> None:
    """Run the HTTP API (publishing and search)."""
    import uvicorn

    from services.app import create_app

    settings = PublisherSettings()
    configure_logging(settings.log_level, settings.log_format, service="kb-publisher")
    config = uvicorn.Config(
        create_app(settings),
        host=host,
        port=port,
        log_level=settings.log_level,
        access_log=False,
        lifespan="on",
        # uvicorn's own startup/shutdown lines go to stderr like every log of ours.
        log_config=None,
    )
    _graceful_server_class()(config).run()


def _graceful_server_class() -> type[Any]:
    import uvicorn

    class GracefulServer(uvicorn.Server):
        """SIGTERM is how orchestrators stop a service: a graceful stop is a success and
        exits 0. uvicorn by default re-raises the signal after shutting down (exit -15),
        which supervisors report as a crash."""

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            super().handle_exit(sig, frame)
            if sig == signal.SIGTERM and sig in self._captured_signals:
                self._captured_signals.remove(sig)

    return GracefulServer
