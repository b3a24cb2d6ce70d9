"""What a log line may hold (services/runtime/log_safety.py): no secret, no frame's locals,
a bounded size -- for our structlog events and for standard-library records alike."""

from __future__ import annotations

import asyncio
import gc
import io
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import structlog
from fastapi.security import HTTPAuthorizationCredentials
from structlog.testing import capture_logs

from services.runtime.log_safety import MAX_FRAMES, MAX_LINE_BYTES, MAX_VALUE_CHARS
from services.runtime.logging import configure_logging, get_logger
from services.runtime.redaction import redact
from services.runtime.web.http_problem import refuse_unread

KEY = "kb.acme.Zx8pQ2vN5mK7tR1wY4uB6cE9fH3jL0sDgA-_xyzabc"
SECRET_PART = KEY.rsplit(".", 1)[-1]


@contextmanager
def logged(monkeypatch: pytest.MonkeyPatch, fmt: str = "json") -> Iterator[io.StringIO]:
    """Logging configured as a process does, onto a captured stderr; as before afterwards.
    Entered in the test itself: pytest puts its own stderr back between set-up and call."""
    captured = io.StringIO()
    monkeypatch.setattr("sys.stderr", captured)
    configure_logging("debug", fmt, service="test")
    try:
        yield captured
    finally:
        structlog.reset_defaults()
        logging.getLogger().handlers.clear()


def _lines(stderr: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stderr.getvalue().splitlines()]


def _clean(stderr: io.StringIO) -> None:
    text = stderr.getvalue()
    for shown in (KEY, SECRET_PART, '"locals"', "HTTPAuthorizationCredentials("):
        assert shown not in text, text
    for line in text.splitlines():
        assert len(line.encode()) <= MAX_LINE_BYTES


def _fail_holding_the_key() -> None:
    credentials = HTTPAuthorizationCredentials(scheme="Bearer", credentials=KEY)
    raise RuntimeError(f"cannot use {credentials.credentials}")


def test_an_exception_is_logged_without_locals_and_with_its_message_redacted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with logged(monkeypatch) as stderr:
        try:
            _fail_holding_the_key()
        except RuntimeError:
            get_logger("t").exception("http.unhandled_error", path="/v1/x")
        _clean(stderr)
        [entry] = _lines(stderr)
        [stack] = entry["exception"]
        assert stack["exc_type"] == "RuntimeError"
        assert stack["exc_value"] == "cannot use kb.acme.***"
        assert stack["frames"][-1]["name"] == "_fail_holding_the_key"


def test_a_logged_object_is_its_repr_redacted(monkeypatch: pytest.MonkeyPatch) -> None:
    with logged(monkeypatch) as stderr:
        credentials = HTTPAuthorizationCredentials(scheme="Bearer", credentials=KEY)
        get_logger("t").info("auth.checked", credentials=credentials, nested={"a": [credentials]})
        text = stderr.getvalue()
        assert KEY not in text
        assert SECRET_PART not in text
        assert "credentials='***'" in text


def test_a_library_record_is_redacted_without_locals_and_logged_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with logged(monkeypatch) as stderr:
        server = logging.getLogger("uvicorn.error")
        try:
            _fail_holding_the_key()
        except RuntimeError as error:
            server.error("Exception in ASGI application", exc_info=error)
        try:
            _fail_holding_the_key()
        except RuntimeError as error:
            get_logger("t").exception("http.unhandled_error")
            # The app's handler logged it; the server's record of the same exception is dropped.
            server.error("Exception in ASGI application", exc_info=error)
        _clean(stderr)
        entries = _lines(stderr)
        assert [e["event"] for e in entries] == [
            "Exception in ASGI application",
            "http.unhandled_error",
        ]
        assert entries[0]["exception"][0]["exc_value"] == "cannot use kb.acme.***"


def test_a_task_exception_nobody_retrieved_is_logged_safely(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with logged(monkeypatch) as stderr:

        async def failing() -> None:
            _fail_holding_the_key()

        async def main() -> None:
            task = asyncio.get_running_loop().create_task(failing())
            await asyncio.wait([task])
            del task
            gc.collect()

        asyncio.run(main())
        _clean(stderr)
        [entry] = [e for e in _lines(stderr) if e.get("logger") == "asyncio" and "exception" in e]
        assert entry["event"].startswith("Task exception was never retrieved")
        assert entry["exception"][0]["exc_type"] == "RuntimeError"


def test_the_environments_secrets_are_masked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KB_EMBEDDING_API_KEY", "sk-live-0123456789abcdef")
    with logged(monkeypatch) as stderr:
        get_logger("t").warning("provider.refused", detail="key sk-live-0123456789abcdef revoked")
        logging.getLogger("some.library").warning("sent sk-live-0123456789abcdef")
        assert "sk-live-0123456789abcdef" not in stderr.getvalue()
        assert stderr.getvalue().count("***") == 2


def _recurse(depth: int) -> None:
    if depth == 0:
        raise ValueError("x" * 100_000)
    _recurse(depth - 1)


def test_a_deep_long_chained_exception_fits_one_bounded_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with logged(monkeypatch) as stderr:
        try:
            try:
                _recurse(300)
            except ValueError as inner:
                raise RuntimeError("y" * 100_000) from inner
        except RuntimeError:
            get_logger("t").exception("worker.crashed")
        _clean(stderr)
        [entry] = _lines(stderr)
        for stack in entry["exception"]:
            assert len(stack["frames"]) <= MAX_FRAMES + 1  # and the "skipped frames" marker
            assert len(stack["exc_value"]) <= MAX_VALUE_CHARS + 40
        assert entry["exception"][-1]["frames"][-1]["name"] == "_recurse"


def test_a_line_over_the_bound_is_cut_to_its_event_and_level(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with logged(monkeypatch) as stderr:
        many = {f"field_{n}": "z" * 1000 for n in range(40)}
        get_logger("t").info("batch.done", **many)
        get_logger("t").info("batch.huge", items=["w" * 10_000] * 1000)
        _clean(stderr)
        cut, huge = _lines(stderr)
        assert (cut["event"], cut["level"]) == ("batch.done", "info")
        assert cut["truncated_bytes"] > MAX_LINE_BYTES
        assert huge["event"] == "batch.huge"


def test_the_console_format_shows_no_locals_and_no_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with logged(monkeypatch, "console") as stderr:
        try:
            _fail_holding_the_key()
        except RuntimeError:
            get_logger("t").exception("http.unhandled_error")
        try:
            _fail_holding_the_key()
        except RuntimeError:
            logging.getLogger("asyncio").error("callback failed", exc_info=True)
        text = stderr.getvalue()
        assert KEY not in text
        assert SECRET_PART not in text
        assert "HTTPAuthorizationCredentials(" not in text
        # The tracebacks are there, without their locals.
        assert text.count("_fail_holding_the_key") >= 2, text


def test_redaction_masks_our_credentials_by_shape() -> None:
    operator_key = "kbop.Q1w2E3r4T5y6U7i8O9p0A1s2D3f4G5h6J7k8L9z0X1c"
    jwt = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJ1c2VyOmFubiJ9.c2lnbmF0dXJlLXNpZ25hdHVyZQ"
    text = redact(
        f"HTTPAuthorizationCredentials(scheme='Bearer', credentials='{KEY}') "
        f"key {KEY} op {operator_key} token {jwt} credentials=abc123 version kb.acme.v2",
        secrets=(),
    )
    for secret in (SECRET_PART, operator_key, jwt, "abc123"):
        assert secret not in text, text
    assert "kb.acme.***" in text
    assert "kbop.***" in text
    assert "kb.acme.v2" in text  # too short to be a key: left alone


async def test_a_client_hanging_up_on_a_refused_upload_is_one_short_line() -> None:
    """A refused upload's body is read and dropped (refuse_unread); a client that hangs up
    meanwhile is logged like any other hang-up, and still counted with the refusal."""
    chunks: list[dict[str, Any]] = [
        {"type": "http.request", "body": b"x" * 1000, "more_body": True},
        {"type": "http.disconnect"},
    ]
    messages = iter(chunks)

    async def receive() -> dict[str, Any]:
        return next(messages)

    sent: list[dict[str, Any]] = []

    async def send(message: Any) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/tenants/acme/documents"}
    with capture_logs() as logs:
        await refuse_unread(
            {**scope, "headers": []},
            receive,
            send,
            status=503,
            code="UPLOADS_BUSY",
            message="busy",
            retry_after_seconds=1,
        )
    assert logs == [
        {
            "event": "request.client_disconnected",
            "log_level": "info",
            "method": "POST",
            "path": "/v1/tenants/acme/documents",
        }
    ]
    assert sent[0]["status"] == 503
