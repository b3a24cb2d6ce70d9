"""Options several `kb` commands share, and what they start. Imports typer only, so that a
command module can use them at import time and `--help` stays cheap."""

from __future__ import annotations

from typing import Any

import typer


def metrics_port_option(help: str) -> Any:
    """``--metrics-port PORT``: serve Prometheus /metrics there (``serve_metrics``)."""
    return typer.Option(None, "--metrics-port", min=1, max=65535, help=help)


def serve_metrics(port: int | None, host: str) -> bool:
    """Serve this process's Prometheus /metrics on ``host:port`` from a thread of its own;
    nothing when ``port`` is None. Whether it serves."""
    if port is None:
        return False
    from prometheus_client import start_http_server

    start_http_server(port, addr=host)
    return True
