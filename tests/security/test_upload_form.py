"""The single uploads' multipart body, read strictly (issue 41), as the bulk endpoint's is
(tests/security/test_bulk_edges.py): a text part that is not UTF-8 -- whatever charset the
request claims -- and a ``file`` part without a filename are refused with 400
``BAD_REQUEST``, the code these routes give any multipart they cannot read, and change
nothing. Starlette alone decoded such a part as Latin-1 (or as the charset the request
claimed) and stored whatever came out, and answered a nameless file part 422 "Expected
UploadFile, received: <class 'str'>"."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import httpx
import pytest

from tests.security.world import Caller, World
from tests.support.api import snapshot
from tests.support.stack import connected

pytestmark = pytest.mark.integration

BOUNDARY = "kbformboundary"
MULTIPART = f"multipart/form-data; boundary={BOUNDARY}"
END = f"--{BOUNDARY}--\r\n".encode()

NOT_UTF8 = {
    "latin-1": "caf\u00e9".encode("latin-1"),
    "byte order mark of UTF-16": b"\xff\xfeR\x00",
    "truncated sequence": b"Refund \xc3",
    "surrogate": b"Refund \xed\xa0\x80",
    "overlong slash": b"Refund \xc0\xaf",
}


@pytest.fixture
async def conn(module_database: str) -> AsyncIterator[asyncpg.Connection[Any]]:
    async with connected(module_database) as connection:
        yield connection


def publisher(world: World) -> Caller:
    return world.acme.caller("publish")


def part(name: str, value: bytes, headers: str = "") -> bytes:
    head = f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="{name}"{headers}\r\n\r\n'
    return head.encode() + value + b"\r\n"


FILE = part("file", b"refund text", '; filename="a.txt"\r\nContent-Type: text/plain')


async def post(
    world: World, path: str, body: bytes, content_type: str = MULTIPART
) -> httpx.Response:
    caller = publisher(world)
    return await world.client.post(
        caller.path(path),
        content=body,
        headers={**caller.headers, "content-type": content_type},
    )


def assert_refused(response: httpx.Response, *words: str) -> None:
    assert response.status_code == 400, response.text
    assert response.headers["content-type"] == "application/problem+json"
    problem = response.json()
    assert problem["errorCode"] == "BAD_REQUEST", problem
    for word in words:
        assert word in problem["detail"], problem


@pytest.mark.parametrize("title", list(NOT_UTF8.values()), ids=list(NOT_UTF8))
async def test_a_title_that_is_not_utf8_is_refused(
    world: World, conn: asyncpg.Connection[Any], title: bytes
) -> None:
    before = await snapshot(conn)
    assert_refused(await post(world, "/documents", part("title", title) + FILE + END), "UTF-8")
    assert await snapshot(conn) == before


async def test_a_claimed_charset_does_not_make_latin1_acceptable(
    world: World, conn: asyncpg.Connection[Any]
) -> None:
    before = await snapshot(conn)
    body = part("title", NOT_UTF8["latin-1"]) + FILE + END
    for charset in ("latin-1", "windows-1252", "no-such-charset"):
        response = await post(world, "/documents", body, f"{MULTIPART}; charset={charset}")
        assert_refused(response, "UTF-8")
    assert await snapshot(conn) == before


async def test_any_other_text_part_that_is_not_utf8_is_refused(
    world: World, conn: asyncpg.Connection[Any]
) -> None:
    before = await snapshot(conn)
    body = part("title", b"Refunds") + FILE + part("note", b"\xff") + END
    assert_refused(await post(world, "/documents", body), "UTF-8", "'note'")
    assert await snapshot(conn) == before


@pytest.mark.parametrize("content", [b"refund text", b"\x89PNG\r\n\x1a\n\xff binary"])
async def test_a_file_part_without_a_filename_is_named_as_such(
    world: World, conn: asyncpg.Connection[Any], content: bytes
) -> None:
    before = await snapshot(conn)
    nameless = part("file", content, "\r\nContent-Type: text/plain")
    response = await post(world, "/documents", part("title", b"Refunds") + nameless + END)
    assert_refused(response, "filename")
    assert await snapshot(conn) == before


async def test_a_new_version_is_read_as_strictly(
    world: World, conn: asyncpg.Connection[Any]
) -> None:
    created = await post(world, "/documents", part("title", b"Versioned") + FILE + END)
    assert created.status_code == 201, created.text
    path = f"/documents/{created.json()['documentId']}/versions"
    before = await snapshot(conn)
    nameless = part("file", b"refund text", "\r\nContent-Type: text/plain")
    assert_refused(await post(world, path, nameless + END), "filename")
    assert_refused(await post(world, path, FILE + part("note", b"caf\xe9") + END), "UTF-8")
    assert await snapshot(conn) == before
    added = await post(world, path, FILE + END)
    assert (added.status_code, added.json()["versionNumber"]) == (201, 2), added.text


async def test_utf8_titles_keep_their_characters(world: World) -> None:
    title = "R\u00fcckerstattung \u00e9t\u00e9 \u65e5\u672c \U0001f4c4"
    for content_type in (MULTIPART, f"{MULTIPART}; charset=latin-1"):
        body = part("title", title.encode()) + FILE + END
        created = await post(world, "/documents", body, content_type)
        assert created.status_code == 201, created.text
        caller = publisher(world)
        status = await world.client.get(
            caller.path(f"/documents/{created.json()['documentId']}"), headers=caller.headers
        )
        assert status.json()["title"] == title, content_type


async def test_other_malformed_multipart_keeps_its_code(
    world: World, conn: asyncpg.Connection[Any]
) -> None:
    before = await snapshot(conn)
    assert_refused(await post(world, "/documents", b"not multipart at all"))
    assert_refused(await post(world, "/documents", FILE + END, "multipart/form-data"))
    assert await snapshot(conn) == before
