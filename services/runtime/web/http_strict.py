"""HTTP strictness (docs/architecture.md#the-http-contract): requests whose meaning two
parties could read differently are refused, never guessed at.

- A request with both ``Content-Length`` and ``Transfer-Encoding`` is refused with 400
  ``AMBIGUOUS_REQUEST_LENGTH`` and its connection closed (``Connection: close``): a proxy in
  front may have framed the body by the other header, and whatever follows on the
  connection (a smuggled second request) is never read. uvicorn's h11 accepts such a
  request and frames it by ``Transfer-Encoding``.
- Duplicate ``Authorization`` (or ``Content-Type``, ``Host``) headers: 400
  ``DUPLICATE_HEADER`` (otherwise one of them wins, perhaps not the one a proxy checked).
- Duplicate keys in a JSON object: 400 ``DUPLICATE_JSON_KEY`` (``json.loads`` keeps the last
  one); :func:`strict_json_loads` for a body read by hand, :class:`StrictJsonMiddleware` for
  the JSON bodies FastAPI parses.
- Forwarded headers (``X-Forwarded-For``/``-Proto``) are read only from the proxies of
  ``KB_HTTP_TRUSTED_PROXIES`` (:func:`proxy_options`, uvicorn's options).
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Iterable
from typing import Any, Final

from pydantic import field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.runtime.errors import BadInput
from services.runtime.web.http_problem import http_exception_response, problem_response

AMBIGUOUS_REQUEST_LENGTH: Final = "AMBIGUOUS_REQUEST_LENGTH"
DUPLICATE_HEADER: Final = "DUPLICATE_HEADER"
DUPLICATE_JSON_KEY: Final = "DUPLICATE_JSON_KEY"

# Headers that must appear at most once (a repeated one is refused, not merged: the app
# would read the first, a proxy in front perhaps the last). h11 itself refuses a repeated
# Host and differing Content-Lengths.
SINGLE_HEADERS: Final = frozenset({b"authorization", b"content-type", b"host"})


class DuplicateJsonKey(BadInput, code=DUPLICATE_JSON_KEY, http_status=400):
    """A JSON object names the same key twice."""


class HttpSettings(BaseSettings):
    """``KB_HTTP_*``: how ``kb serve`` reads the HTTP it is sent."""

    model_config = SettingsConfigDict(env_prefix="KB_HTTP_", frozen=True, extra="ignore")

    # Comma-separated IPs or CIDRs of the reverse proxies whose X-Forwarded-For /
    # X-Forwarded-Proto are believed. Empty (the default): no one's.
    trusted_proxies: str = ""

    @field_validator("trusted_proxies")
    @classmethod
    def _networks(cls, value: str) -> str:
        for item in _split(value):
            try:
                ipaddress.ip_network(item, strict=False)
            except ValueError:
                raise ValueError(f"not an IP address or CIDR: {item!r}") from None
        return value

    def trusted_proxy_list(self) -> list[str]:
        return _split(self.trusted_proxies)


def _split(value: str) -> list[str]:
    return [item.strip() for item in value.split(",") if item.strip()]


def proxy_options(settings: HttpSettings) -> dict[str, Any]:
    """uvicorn's options for forwarded headers: without trusted proxies its proxy-headers
    middleware is off (by default it believes 127.0.0.1 and ``FORWARDED_ALLOW_IPS``)."""
    proxies = settings.trusted_proxy_list()
    if not proxies:
        return {"proxy_headers": False, "forwarded_allow_ips": []}
    return {"proxy_headers": True, "forwarded_allow_ips": proxies}


def _reject_duplicates(pairs: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise DuplicateJsonKey(f"the JSON object names the key {key[:100]!r} more than once")
        result[key] = value
    return result


def strict_json_loads(data: str | bytes) -> Any:
    """``json.loads`` refusing duplicate object keys (:class:`DuplicateJsonKey`); invalid
    JSON raises ``ValueError`` as ``json.loads`` does."""
    return json.loads(data, object_pairs_hook=_reject_duplicates)


def _problem(status: int, code: str, detail: str, scope: Scope, *, close: bool) -> ASGIApp:
    headers = {"Connection": "close"} if close else None
    return problem_response(status, code, detail, instance=scope.get("path"), headers=headers)


class StrictHeadersMiddleware:
    """Outermost: refuses ambiguous framing and repeated single headers before anything
    (auth, body limits) reads the request. Closes the connection on every refusal: the
    body was not read, so the connection's next bytes are not a request we can trust."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = header_refusal(scope)
        if refusal is not None:
            code, detail = refusal
            await _problem(400, code, detail, scope, close=True)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def header_refusal(scope: Scope) -> tuple[str, str] | None:
    """The code and detail a request's headers are refused with, or ``None``."""
    seen: set[bytes] = set()
    for raw_name, _ in scope["headers"]:
        name = bytes(raw_name).lower()
        if name in SINGLE_HEADERS and name in seen:
            return DUPLICATE_HEADER, f"the {name.decode()} header is sent more than once"
        seen.add(name)
    if b"content-length" in seen and b"transfer-encoding" in seen:
        return (
            AMBIGUOUS_REQUEST_LENGTH,
            "the request has both Content-Length and Transfer-Encoding",
        )
    return None


def is_json(scope: Scope) -> bool:
    for name, value in scope["headers"]:
        if bytes(name).lower() == b"content-type":
            media = bytes(value).split(b";", 1)[0].strip().lower()
            return media == b"application/json" or media.endswith(b"+json")
    return False


class StrictJsonMiddleware:
    """Refuses a JSON body (``application/json`` or ``*+json``) with a duplicate object key.

    It buffers the body, so it must sit inside the body-size limit (the limit's receive is
    the one it reads); the body is then replayed to the app as one message. A body that is
    not valid JSON passes through: the app answers it as it always has."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_json(scope):
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        try:
            while True:
                message = await receive()
                if message["type"] != "http.request":  # disconnected
                    return
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    break
        except StarletteHTTPException as exc:  # the body limit's 413 / 408
            await http_exception_response(exc, scope.get("path"))(scope, receive, send)
            return
        body = b"".join(chunks)
        try:
            strict_json_loads(body)
        except DuplicateJsonKey as error:
            await _problem(400, error.code, error.message, scope, close=False)(scope, receive, send)
            return
        except (ValueError, RecursionError):
            pass  # invalid (or too deep) JSON: the app's own answer, as before
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
