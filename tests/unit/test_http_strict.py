"""HTTP strictness (services/runtime/web/http_strict.py), against the composed app served by a
real uvicorn (the `kb serve` options) on a loopback port: raw sockets, so that what the
client library would normalise (duplicate headers, framing) reaches the server as sent."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import uvicorn
from starlette.types import Receive, Scope, Send

from services.app import create_app
from services.embedding.hashing import HashingEmbedder
from services.publisher.settings import PublisherSettings
from services.publisher.web.api import PublisherStores
from services.publisher.web.bulk_routes import _items
from services.runtime.commands.cli_support import load_settings
from services.runtime.errors import ConfigError
from services.runtime.tenancy.tenant_auth import hash_api_key, new_api_key
from services.runtime.web.http_strict import (
    DuplicateJsonKey,
    HttpSettings,
    proxy_options,
    strict_json_loads,
)
from services.search.searcher import Searcher
from services.serve import server_config
from tests.fakes.publisher_store import MemoryPublisherStore
from tests.fakes.search_index import DIMENSION, FakeIndex

SETTINGS = PublisherSettings(database_url="postgresql://unused/kb")


@contextmanager
def serving(app: Any, http: HttpSettings | None = None) -> Iterator[int]:
    """``app`` under uvicorn with `kb serve`'s configuration, in a thread; yields the port."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port: int = sock.getsockname()[1]
    config = server_config(
        app, host="127.0.0.1", port=0, settings=SETTINGS, http=http or HttpSettings()
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="http-strict", daemon=True
    )
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


@pytest.fixture(scope="module")
def api() -> Iterator[tuple[int, str]]:
    store = MemoryPublisherStore()
    key = new_api_key("acme")
    store.add_tenant("acme", "standard", hash_api_key(key))
    searcher = Searcher(HashingEmbedder(DIMENSION), FakeIndex())
    with serving(create_app(SETTINGS, stores=PublisherStores(store), searcher=searcher)) as port:
        yield port, key


def exchange(
    port: int, raw: bytes, *, expect: int = 1, quiet: float = 0.5, deadline: float = 30.0
) -> bytes:
    """Send ``raw``; everything the server answers until it closes, or until ``expect``
    complete answers have come and then ``quiet`` seconds pass without more (an answer that
    should not exist, e.g. to a smuggled request, would come in that time). Never a fixed
    wait for the expected answers: a loaded machine may take seconds to give them."""
    with socket.create_connection(("127.0.0.1", port), timeout=deadline) as conn:
        conn.sendall(raw)
        received = b""
        try:
            while chunk := conn.recv(65536):
                received += chunk
                if complete_answers(received) >= expect:
                    conn.settimeout(quiet)
        except TimeoutError:
            pass
        return received


def complete_answers(received: bytes) -> int:
    """How many answers in ``received`` have their head and whole body (Content-Length)."""
    count = 0
    while (end := received.find(b"\r\n\r\n")) >= 0:
        length = re.search(rb"(?im)^content-length: *(\d+)\r?$", received[:end])
        size = int(length.group(1)) if length else 0
        if len(received) < end + 4 + size:
            break
        count += 1
        received = received[end + 4 + size :]
    return count


def answers(received: bytes) -> list[int]:
    """The status of every answer in ``received`` (a pipelined answer follows the previous
    body directly)."""
    return [int(status) for status in re.findall(rb"HTTP/1\.1 (\d{3}) ", received)]


def problem_code(received: bytes) -> str:
    code: str = json.loads(received.partition(b"\r\n\r\n")[2])["errorCode"]
    return code


def search(port: int, key: str, body: bytes) -> bytes:
    head = search_head(key, f"Content-Length: {len(body)}")
    return exchange(port, head.encode() + body)


def search_head(key: str, *extra: str) -> str:
    lines = [
        "POST /v1/tenants/acme/search HTTP/1.1",
        "Host: api",
        f"Authorization: Bearer {key}",
        "Content-Type: application/json",
        *extra,
    ]
    return "\r\n".join(lines) + "\r\n\r\n"


SMUGGLED = b"GET /healthz HTTP/1.1\r\nHost: api\r\n\r\n"


def test_pipelined_requests_are_both_answered_when_framing_is_clear(api: tuple[int, str]) -> None:
    """The control: the smuggled request below would be answered on a kept-alive connection."""
    port, _ = api
    received = exchange(port, SMUGGLED + SMUGGLED, expect=2)
    assert answers(received) == [200, 200]


def test_content_length_with_transfer_encoding_is_refused_and_the_connection_closed(
    api: tuple[int, str],
) -> None:
    port, key = api
    head = search_head(key, "Content-Length: 5", "Transfer-Encoding: chunked")
    received = exchange(port, head.encode() + b"0\r\n\r\n" + SMUGGLED)
    assert answers(received) == [400]  # the smuggled GET is never answered
    head_bytes, _, body = received.partition(b"\r\n\r\n")
    assert b"connection: close" in head_bytes.lower()
    assert b"application/problem+json" in head_bytes
    assert json.loads(body)["errorCode"] == "AMBIGUOUS_REQUEST_LENGTH"
    assert received.count(b"HTTP/1.1") == 1


@pytest.mark.parametrize(
    "header", ["Authorization: Bearer kb.acme.other", "Content-Type: text/plain"]
)
def test_duplicate_single_headers_are_refused(api: tuple[int, str], header: str) -> None:
    port, key = api
    body = b'{"query": "refund", "principals": ["p"]}'
    head = search_head(key, header, f"Content-Length: {len(body)}")
    received = exchange(port, head.encode() + body)
    assert answers(received) == [400]
    assert problem_code(received) == "DUPLICATE_HEADER"
    assert b"connection: close" in received.partition(b"\r\n\r\n")[0].lower()


def test_duplicate_json_keys_are_refused_and_a_clean_body_passes(api: tuple[int, str]) -> None:
    port, key = api
    duplicate = b'{"query": "refund", "principals": ["p"], "principals": ["everyone"]}'
    clean = b'{"query": "refund", "principals": ["p"]}'
    refused = exchange(
        port, search_head(key, f"Content-Length: {len(duplicate)}").encode() + duplicate
    )
    assert answers(refused) == [400]
    problem = json.loads(refused.partition(b"\r\n\r\n")[2])
    assert problem["errorCode"] == "DUPLICATE_JSON_KEY"
    passed = exchange(port, search_head(key, f"Content-Length: {len(clean)}").encode() + clean)
    assert answers(passed) == [200]


def test_a_nested_duplicate_and_the_body_limit_still_apply(api: tuple[int, str]) -> None:
    port, key = api
    nested = b'{"query": "q", "principals": ["p"], "filters": {"a": 1, "a": 2}}'
    received = exchange(port, search_head(key, f"Content-Length: {len(nested)}").encode() + nested)
    assert json.loads(received.partition(b"\r\n\r\n")[2])["errorCode"] == "DUPLICATE_JSON_KEY"
    # A chunked body past the JSON limit: 413 from the limit, not buffered whole.
    big = b'{"query": "' + b"x" * (SETTINGS.publisher_max_json_body_bytes + 10) + b'"}'
    chunked = f"{len(big):x}\r\n".encode() + big + b"\r\n0\r\n\r\n"
    received = exchange(port, search_head(key, "Transfer-Encoding: chunked").encode() + chunked)
    assert answers(received) == [413]


def test_redirects_never_carry_the_host_header(api: tuple[int, str]) -> None:
    port, _ = api
    request = b"GET /ui HTTP/1.1\r\nHost: evil.example\r\nX-Forwarded-Host: evil.example\r\n\r\n"
    received = exchange(port, request)
    assert answers(received) == [303]
    location = [line for line in received.split(b"\r\n") if line.lower().startswith(b"location:")]
    assert location == [b"location: /ui/login"]


def test_the_bulk_items_part_refuses_duplicate_keys() -> None:
    with pytest.raises(DuplicateJsonKey) as caught:
        _items(['[{"title": "a", "title": "b"}]'], [])
    assert caught.value.code == "DUPLICATE_JSON_KEY"
    assert caught.value.http_status == 400


def test_strict_json_loads() -> None:
    assert strict_json_loads('{"a": {"b": 1}, "c": [{"b": 2}]}') == {"a": {"b": 1}, "c": [{"b": 2}]}
    with pytest.raises(DuplicateJsonKey):
        strict_json_loads('[{"a": 1, "a": 1}]')
    with pytest.raises(json.JSONDecodeError):
        strict_json_loads("{")


# --- forwarded headers -------------------------------------------------------------------


async def echo_client(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] != "http":
        return
    body = f"{scope['client'][0]} {scope['scheme']}".encode()
    headers = [(b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


FORWARDED = (
    b"GET / HTTP/1.1\r\nHost: api\r\nX-Forwarded-For: 203.0.113.9\r\n"
    b"X-Forwarded-Proto: https\r\nConnection: close\r\n\r\n"
)


@pytest.mark.parametrize(
    ("trusted", "seen"),
    [
        ("", b"127.0.0.1 http"),  # uvicorn's default would believe 127.0.0.1
        ("10.0.0.0/8, 192.0.2.1", b"127.0.0.1 http"),
        ("10.0.0.0/8,127.0.0.0/8", b"203.0.113.9 https"),
    ],
)
def test_forwarded_headers_are_believed_only_from_trusted_proxies(
    trusted: str, seen: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("FORWARDED_ALLOW_IPS", raising=False)
    monkeypatch.setenv("KB_HTTP_TRUSTED_PROXIES", trusted)
    with serving(echo_client, load_settings(HttpSettings)) as port:
        received = exchange(port, FORWARDED)
    assert received.endswith(b"\r\n\r\n" + seen)


def test_trusted_proxies_must_be_addresses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KB_HTTP_TRUSTED_PROXIES", "10.0.0.0/8,proxy.internal")
    with pytest.raises(ConfigError):
        load_settings(HttpSettings)
    monkeypatch.delenv("KB_HTTP_TRUSTED_PROXIES")
    assert proxy_options(HttpSettings()) == {"proxy_headers": False, "forwarded_allow_ips": []}
