"""RFC 9457 problem details (``application/problem+json``) for every HTTP error.

Every error answer carries a stable ``errorCode`` (the ``KbError.code``, or one of the codes
below for errors raised by the framework itself), so clients branch on the code and never
on the message text. 5xx answers never echo internal details; they are logged instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from http import HTTPStatus
from typing import Any, Final

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

from services.runtime.errors import KbError, Unauthenticated
from services.runtime.log_safety import mark_logged
from services.runtime.logging import get_logger

PROBLEM_MEDIA_TYPE: Final = "application/problem+json"

# Codes of the errors the framework raises before our code runs.
FRAMEWORK_CODES: Final = {
    400: "BAD_REQUEST",
    401: "UNAUTHENTICATED",
    403: "FORBIDDEN",
    404: "ROUTE_NOT_FOUND",
    405: "METHOD_NOT_ALLOWED",
    406: "NOT_ACCEPTABLE",
    408: "REQUEST_TIMEOUT",
    413: "PAYLOAD_TOO_LARGE",
    415: "UNSUPPORTED_MEDIA_TYPE",
    422: "VALIDATION_FAILED",
}
MALFORMED_JSON: Final = "MALFORMED_JSON"
# When a retriable failure (database busy or unreachable) may be tried again.
RETRY_AFTER_SECONDS: Final = "1"
MALFORMED_BODY: Final = "MALFORMED_BODY"

log = get_logger(__name__)


class FieldError(BaseModel):
    loc: list[str | int]
    msg: str
    type: str


class Problem(BaseModel):
    """The body of every error answer."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    type: str = Field(description="A URI naming the kind of problem.")
    title: str
    status: int
    detail: str
    error_code: str = Field(alias="errorCode", description="Stable; branch on this.")
    errors: list[FieldError] | None = Field(
        default=None, description="Per-field details of a validation failure."
    )


PROBLEM_RESPONSE: Final[dict[str, Any]] = {
    "model": Problem,
    "content": {PROBLEM_MEDIA_TYPE: {"schema": {"$ref": "#/components/schemas/Problem"}}},
}


def problem_response(
    status: int,
    code: str,
    detail: str,
    *,
    instance: str | None = None,
    extra: Mapping[str, Any] | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    body: dict[str, Any] = {
        "type": f"urn:kb:problem:{code.lower().replace('_', '-')}",
        "title": _title(status),
        "status": status,
        "detail": detail,
        "errorCode": code,
    }
    if instance is not None:
        body["instance"] = instance
    if extra:
        body.update(extra)
    return JSONResponse(
        body, status_code=status, media_type=PROBLEM_MEDIA_TYPE, headers=dict(headers or {})
    )


def _title(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"


def kb_error_response(error: KbError, instance: str | None = None) -> JSONResponse:
    status = error.http_status
    # RFC 9110: a 401 names the scheme that would be accepted.
    headers = {"WWW-Authenticate": "Bearer"} if isinstance(error, Unauthenticated) else None
    if status >= 500:
        # Internal details stay in the log; the client gets the stable code only.
        log.error("http.server_error", error_code=error.code, error=error.message)
        detail = "the service could not complete the request; it is safe to retry"
        if not error.retriable:
            detail = "the service failed to complete the request"
        retry = {"Retry-After": RETRY_AFTER_SECONDS} if error.retriable else None
        return problem_response(status, error.code, detail, instance=instance, headers=retry)
    extra = getattr(error, "problem_fields", None)
    return problem_response(
        status, error.code, error.message, instance=instance, extra=extra, headers=headers
    )


def http_exception_response(
    exc: StarletteHTTPException, instance: str | None = None
) -> JSONResponse:
    code = FRAMEWORK_CODES.get(exc.status_code, "HTTP_ERROR")
    detail = str(exc.detail) if exc.detail else _title(exc.status_code)
    if exc.status_code == 400 and "parsing the body" in detail:
        code = MALFORMED_BODY
    return problem_response(exc.status_code, code, detail, instance=instance, headers=exc.headers)


def _field_errors(exc: RequestValidationError) -> list[dict[str, Any]]:
    errors = []
    for error in exc.errors():
        errors.append(
            {
                "loc": [part if isinstance(part, int) else str(part) for part in error["loc"]],
                "msg": str(error.get("msg", "")),
                "type": str(error.get("type", "")),
            }
        )
    return errors


def document_errors_as_problem_json(app: FastAPI) -> None:
    """Error answers are documented as application/problem+json only (FastAPI would also
    list the route's default application/json for them)."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = generate()
        for path_item in schema.get("paths", {}).values():
            for operation in path_item.values():
                for status, response in operation.get("responses", {}).items():
                    content = response.get("content", {})
                    if status[:1] in {"4", "5"} and PROBLEM_MEDIA_TYPE in content:
                        content.pop("application/json", None)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def install_problem_handlers(app: FastAPI) -> None:
    """Answer every error raised in ``app`` as problem+json."""

    async def on_kb_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, KbError)
        return kb_error_response(exc, request.url.path)

    async def on_http_exception(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        # FastAPI answers a body it could not read 400, whatever the reason: a client that
        # hung up is told nothing (it is gone), but the log says what happened.
        if isinstance(exc.__cause__, ClientDisconnect):
            _client_disconnected(request.method, request.url.path)
        return http_exception_response(exc, request.url.path)

    async def on_validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        errors = _field_errors(exc)
        if any(e["type"] == "json_invalid" for e in errors):
            return problem_response(
                400,
                MALFORMED_JSON,
                "the request body is not valid JSON",
                instance=request.url.path,
                extra={"errors": errors},
            )
        return problem_response(
            422,
            FRAMEWORK_CODES[422],
            "the request does not match the API: see errors",
            instance=request.url.path,
            extra={"errors": errors},
        )

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        if isinstance(exc, ClientDisconnect):
            # Expected (a client gives up mid-upload): one short line, and the server's own
            # "Exception in ASGI application" for it is dropped (services/runtime/log_safety.py).
            mark_logged(exc)
            _client_disconnected(request.method, request.url.path)
            return http_exception_response(
                StarletteHTTPException(400, "the client disconnected"), request.url.path
            )
        # Type, message and frames, without locals, redacted and bounded (log_safety.py).
        log.exception("http.unhandled_error", path=request.url.path)
        return problem_response(500, "INTERNAL_ERROR", "the service failed to complete the request")

    app.add_exception_handler(KbError, on_kb_error)
    app.add_exception_handler(StarletteHTTPException, on_http_exception)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(Exception, on_unexpected)


def _client_disconnected(method: str, path: str) -> None:
    log.info("request.client_disconnected", method=method, path=path)


async def refuse_unread(
    scope: Scope,
    receive: Receive,
    send: Send,
    *,
    status: int,
    code: str,
    message: str,
    retry_after_seconds: int,
) -> None:
    """Answer a request refused before its handler ran, with ``Retry-After``. Its body is
    read to the end and dropped first (the body limit and its read timeout still apply to
    every chunk), so the answer never races a client still sending; a client waiting for
    ``100 Continue`` is answered at once and never sends it."""
    if not _expects_continue(scope):
        try:
            disconnected = await _discard_body(receive)
        except StarletteHTTPException as error:  # too large, or stalled
            await http_exception_response(error, scope["path"])(scope, receive, send)
            return
        if disconnected:
            # Answered all the same (nobody reads it): the refusal is counted as one.
            _client_disconnected(scope["method"], scope["path"])
    await problem_response(
        status,
        code,
        message,
        instance=scope["path"],
        headers={"Retry-After": str(retry_after_seconds)},
    )(scope, receive, send)


def _expects_continue(scope: Scope) -> bool:
    return any(
        name.lower() == b"expect" and bytes(value).strip().lower() == b"100-continue"
        for name, value in scope["headers"]
    )


async def _discard_body(receive: Receive) -> bool:
    """Whether the client hung up before the end of its body."""
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return True
        if not message.get("more_body", False):
            return False
