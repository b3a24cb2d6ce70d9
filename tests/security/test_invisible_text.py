"""Characters that hide or reorder text (issue 41): format characters, line and paragraph
separators, variation selectors, tag characters, fillers, lone surrogates. A title or a
principal holding one is refused wherever it comes in -- a new document's title, a bulk
item, a publish's ACL, a search's principals, a principal token's -- and changes nothing.
Ordinary non-ASCII text is kept as sent (NFC)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import httpx
import pytest

from tests.security.test_auth_matrix import assert_no_leak
from tests.security.world import QUERY, Caller, World
from tests.support.api import snapshot
from tests.support.stack import connected

pytestmark = pytest.mark.integration

HIDDEN: dict[str, str] = {
    "soft hyphen": "\u00ad",
    "combining grapheme joiner": "\u034f",
    "arabic letter mark": "\u061c",
    "hangul choseong filler": "\u115f",
    "khmer inherent vowel": "\u17b4",
    "mongolian variation selector": "\u180b",
    "mongolian vowel separator": "\u180e",
    "zero-width space": "\u200b",
    "left-to-right mark": "\u200e",
    "right-to-left override": "\u202e",
    "line separator": "\u2028",
    "paragraph separator": "\u2029",
    "word joiner": "\u2060",
    "invisible plus": "\u2064",
    "left-to-right isolate": "\u2066",
    "hangul filler": "\u3164",
    "variation selector 1": "\ufe00",
    "variation selector 16": "\ufe0f",
    "byte order mark": "\ufeff",
    "halfwidth hangul filler": "\uffa0",
    "interlinear annotation anchor": "\ufff9",
    "noncharacter": "\ufffe",
    "language tag": "\U000e0001",
    "tag latin a": "\U000e0041",
    "variation selector 17": "\U000e0100",
    "musical begin beam": "\U0001d173",
    "braille blank": "\u2800",
    "lone surrogate": "\ud800",  # only a JSON escape can carry it
}
# Only JSON (an escape) carries a lone surrogate: a multipart text part is UTF-8 bytes.
ENCODABLE = {name: ch for name, ch in HIDDEN.items() if name != "lone surrogate"}
VISIBLE = ["Caf\u00e9", "R\u00fcckerstattung \u2013 2026", "\u65e5\u672c\u8a9e", "Doc \U0001f4c4"]


@pytest.fixture
async def conn(module_database: str) -> AsyncIterator[asyncpg.Connection[Any]]:
    async with connected(module_database) as connection:
        yield connection


def _refused(response: httpx.Response, code: str, ch: str = "") -> None:
    assert response.status_code == 422, response.text
    assert response.headers["content-type"] == "application/problem+json"
    # A JSON body's schema already refuses a lone surrogate (VALIDATION_FAILED).
    codes = {code, "VALIDATION_FAILED"} if ch == HIDDEN["lone surrogate"] else {code}
    assert response.json()["errorCode"] in codes


async def _post_json(world: World, caller: Caller, path: str, body: Any) -> httpx.Response:
    # json.dumps escapes what is not ASCII: a lone surrogate travels as "\ud800".
    return await world.client.post(
        caller.path(path),
        content=json.dumps(body),
        headers={**caller.headers, "content-type": "application/json"},
    )


async def _create(world: World, title: str) -> httpx.Response:
    caller = world.acme.caller("publish")
    return await world.client.post(
        caller.path("/documents"),
        files={"file": ("a.txt", b"refund text", "text/plain")},
        data={"title": title},
        headers=caller.headers,
    )


async def _bulk(world: World, items: list[dict[str, Any]]) -> httpx.Response:
    caller = world.acme.caller("publish")
    parts: list[tuple[str, Any]] = [("items", (None, json.dumps(items), "application/json"))]
    parts += [("file", (f"{n}.txt", b"refund text", "text/plain")) for n in range(len(items))]
    return await world.client.post(
        caller.path("/documents/bulk"), files=parts, headers=caller.headers
    )


@pytest.mark.parametrize("name", list(ENCODABLE))
async def test_a_title_with_a_hidden_character_is_refused(
    world: World, conn: asyncpg.Connection[Any], name: str
) -> None:
    before = await snapshot(conn)
    for title in (f"Refund{HIDDEN[name]}policy", f"{HIDDEN[name]}Refund", f"Refund{HIDDEN[name]}"):
        _refused(await _create(world, title), "TITLE_INVALID")
    assert await snapshot(conn) == before


async def test_bulk_items_with_a_hidden_character_are_refused_alone(
    world: World, conn: asyncpg.Connection[Any]
) -> None:
    before = await snapshot(conn)
    read = {"read": ["group:support"]}
    items = [{"title": f"Refund{ch}policy", "acl": read} for ch in ENCODABLE.values()]
    items += [
        {"title": "Refunds", "acl": {"read": [f"group:{ch}support"]}} for ch in ENCODABLE.values()
    ]
    response = await _bulk(world, items)
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    expected = ["TITLE_INVALID"] * len(ENCODABLE) + ["PRINCIPAL_INVALID"] * len(ENCODABLE)
    assert [(r["status"], r["errorCode"]) for r in results] == [(422, c) for c in expected]
    # A lone surrogate (a JSON escape) is no string to the items' schema: the request is
    # refused whole.
    surrogate = [{"title": f"Refund{HIDDEN['lone surrogate']}", "acl": read}]
    refused = await _bulk(world, surrogate)
    assert (refused.status_code, refused.json()["errorCode"]) == (400, "BULK_INVALID")
    assert await snapshot(conn) == before


async def test_a_publish_with_a_hidden_character_in_a_principal_is_refused(
    world: World, conn: asyncpg.Connection[Any]
) -> None:
    created = await _create(world, "Published later")
    assert created.status_code == 201, created.text
    document_id = created.json()["documentId"]
    caller = world.acme.caller("publish")
    before = await snapshot(conn)
    for ch in HIDDEN.values():
        response = await _post_json(
            world,
            caller,
            f"/documents/{document_id}/versions/1/publish",
            {"revision": 1, "acl": {"read": ["group:support", f"group:{ch}support"]}},
        )
        _refused(response, "PRINCIPAL_INVALID", ch)
    assert await snapshot(conn) == before


@pytest.mark.parametrize("name", list(HIDDEN))
async def test_a_search_as_a_principal_with_a_hidden_character_is_refused(
    world: World, name: str
) -> None:
    caller = world.acme.caller("search")
    ch = HIDDEN[name]
    # Surrounding whitespace (U+2028 and U+2029 are) is trimmed, as it always was in search.
    for principal in [f"group:{ch}support"] + ([] if ch.isspace() else [f"group:support{ch}"]):
        body = {"query": QUERY, "principals": ["user:alice", principal]}
        response = await _post_json(world, caller, "/search", body)
        _refused(response, "PRINCIPAL_INVALID", ch)
        assert_no_leak(world, response)


@pytest.mark.parametrize("name", list(HIDDEN))
async def test_a_token_principal_with_a_hidden_character_is_refused_alike(
    world: World, name: str
) -> None:
    token = world.token(["user:alice", f"group:sup{HIDDEN[name]}port"])
    response = await world.search(world.acme.caller("token_only"), {"principalToken": token})
    _refused(response, "PRINCIPAL_INVALID")
    assert_no_leak(world, response)


@pytest.mark.parametrize("title", VISIBLE)
async def test_visible_non_ascii_text_is_kept(world: World, title: str) -> None:
    created = await _create(world, title)
    assert created.status_code == 201, created.text
    caller = world.acme.caller("publish")
    document_id = created.json()["documentId"]
    status = await world.client.get(
        caller.path(f"/documents/{document_id}"), headers=caller.headers
    )
    assert status.json()["title"] == title
    published = await world.client.post(
        caller.path(f"/documents/{document_id}/versions/1/publish"),
        json={"revision": 1, "acl": {"read": [f"group:{title}"]}},
        headers=caller.headers,
    )
    assert published.status_code == 202, published.text
    searched = await world.search(world.acme.caller("search"), {"principals": [f"group:{title}"]})
    assert searched.status_code == 200, searched.text
