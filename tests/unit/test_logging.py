"""Logs of libraries render like ours, to the stderr of the moment, without their noise."""

from __future__ import annotations

import io
import json
import logging

import pytest

from services.runtime.logging import configure_logging


def test_library_logs_are_json_on_the_current_stderr_without_tracing_noise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    configured_with = io.StringIO()
    monkeypatch.setattr("sys.stderr", configured_with)
    configure_logging("info", "json", service="test")
    configured_with.close()  # a captured stream that is gone by the time anything logs
    now = io.StringIO()
    monkeypatch.setattr("sys.stderr", now)

    logging.getLogger("some.library").warning("port %s busy", 8080)
    logging.getLogger("aiokafka").error("Unable connect to node with id 1")  # per retry
    logging.getLogger("markdown_it").debug("entering code")

    lines = now.getvalue().splitlines()
    assert len(lines) == 1
    entry = json.loads(lines[0])
    assert entry["event"] == "port 8080 busy"
    assert (entry["level"], entry["logger"], entry["service"]) == (
        "warning",
        "some.library",
        "test",
    )


def test_aiokafka_speaks_at_debug(monkeypatch: pytest.MonkeyPatch) -> None:
    now = io.StringIO()
    monkeypatch.setattr("sys.stderr", now)
    configure_logging("debug", "json", service="test")
    logging.getLogger("aiokafka").error("Unable connect to node with id 1")
    assert "Unable connect" in now.getvalue()
    configure_logging("info", "json", service="test")


def test_http_clients_log_requests_only_at_debug(monkeypatch: pytest.MonkeyPatch) -> None:
    now = io.StringIO()
    monkeypatch.setattr("sys.stderr", now)
    configure_logging("info", "json", service="test")
    request = 'HTTP Request: POST http://127.0.0.1/v1/embeddings "HTTP/1.1 200 OK"'
    logging.getLogger("httpx").info(request)  # one line per embedding request
    logging.getLogger("httpx").warning("connection pool full")
    assert [json.loads(line)["event"] for line in now.getvalue().splitlines()] == [
        "connection pool full"
    ]
    configure_logging("debug", "json", service="test")
    logging.getLogger("httpx").info(request)
    events = [json.loads(line)["event"] for line in now.getvalue().splitlines()]
    assert events[-1] == request
    configure_logging("info", "json", service="test")
