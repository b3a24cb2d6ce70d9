"""`kb serve`: the HTTP API of services/app.py -- the publisher's routes, search and the
operator page -- with the publisher's server limits and a graceful SIGTERM."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import typer

from services.runtime.backoff import Backoff
from services.runtime.commands.cli_options import metrics_port_option, serve_metrics

if TYPE_CHECKING:
    import uvicorn

    from services.publisher.settings import PublisherSettings
    from services.runtime.web.http_strict import HttpSettings

# The start's retries: soon at first, then every few seconds (a readiness probe's period).
START_BACKOFF = Backoff(0.5, 5.0, 0.5)


def serve(
    host: str = typer.Option("127.0.0.1", "--host", help="Interface to listen on."),
    port: int = typer.Option(8080, "--port", min=0, max=65535, help="TCP port."),
    metrics_port: int | None = metrics_port_option(
        "Also serve Prometheus /metrics on 127.0.0.1:PORT (the API serves /metrics too)."
    ),
) -> None:
    """Run the HTTP API (publishing and search)."""
    from services.app import create_app
    from services.operator.settings import OperatorSettings
    from services.publisher.settings import PublisherSettings
    from services.publisher.web.server import GracefulServer
    from services.runtime.commands.cli_support import load_settings
    from services.runtime.logging import configure_logging
    from services.runtime.tracing.setup import configure_tracing
    from services.runtime.web.http_strict import HttpSettings
    from services.runtime.web.starting import start_in_background

    settings = load_settings(PublisherSettings)
    http_settings = load_settings(HttpSettings)
    # Read before serving: a bad KB_OPERATOR_* (a short token) stops the start, exit 2.
    operator_settings = load_settings(OperatorSettings)
    configure_logging(settings.log_level, settings.log_format, service="kb-api")
    configure_tracing("kb-api")
    serve_metrics(metrics_port, "127.0.0.1")
    app = create_app(settings, operator_settings=operator_settings)
    config = server_config(app, host=host, port=port, settings=settings, http=http_settings)
    # It listens at once: a database away at start is waited for (database.unavailable),
    # /healthz answering 200 and /readyz 503 meanwhile (services/runtime/web/starting.py).
    server = GracefulServer(config)
    start = start_in_background(
        app, START_BACKOFF, on_failure=lambda _: setattr(server, "should_exit", True)
    )
    server.run()
    if start.failure is not None:
        raise start.failure


def server_config(
    app: Any, *, host: str, port: int, settings: PublisherSettings, http: HttpSettings
) -> uvicorn.Config:
    """uvicorn's configuration of `kb serve`: the publisher's server limits, and forwarded
    headers believed only from ``KB_HTTP_TRUSTED_PROXIES`` (none by default)."""
    import uvicorn

    from services.publisher.web.server import uvicorn_options
    from services.runtime.web.http_strict import proxy_options

    options = {**uvicorn_options(settings), **proxy_options(http)}
    return uvicorn.Config(app, host=host, port=port, **options)
