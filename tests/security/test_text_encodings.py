"""Text is read only in text encodings (issue 41, items 1 and 4): an HTML ``<meta charset>``
naming a decompressor, a bytes-to-bytes or text-to-text codec, UTF-7 or a label that is no
WHATWG text encoding is refused 415 MEDIA_TYPE_MISMATCH, never decoded; in bulk the item is
refused alone. The check runs off the event loop, so an upload never stalls another
tenant's searches. Binary bytes under a text type are refused too."""

from __future__ import annotations

import asyncio
import json
import struct
import time
import zlib
from typing import Any

import httpx
import pytest

from tests.security.world import Caller, World
from tests.support.documents import make_pdf

pytestmark = pytest.mark.integration

# Today's check inflated this on the event loop (about 5 s here, 2 GB held for the while):
# far past the bound below. Refused by its label, it is never inflated.
_BOMB_INFLATED = 1 << 30
# Generous: another tenant's search takes milliseconds; the bomb stalled the loop for seconds.
_SEARCH_BOUND_SECONDS = 2.0


def zlib_bomb(inflated: int) -> bytes:
    """A zlib stream announcing ``<meta charset="zlib">`` in its first (stored) block and
    inflating to ``inflated`` bytes of spaces: a valid HTML page once decoded "in zlib"."""
    head = b'<html><meta charset="zlib"><body>'
    stored = b"\x00" + struct.pack("<HH", len(head), 0xFFFF ^ len(head)) + head
    chunk = b" " * (1 << 20)
    compressor = zlib.compressobj(9, zlib.DEFLATED, -15)
    # A full flush resets the window: every chunk compresses to the same bytes.
    first = compressor.compress(chunk) + compressor.flush(zlib.Z_FULL_FLUSH)
    repeated = compressor.compress(chunk) + compressor.flush(zlib.Z_FULL_FLUSH)
    count = inflated >> 20
    body = first + repeated * (count - 1) + compressor.flush()
    checksum = zlib.adler32(head)
    for _ in range(count):
        checksum = zlib.adler32(chunk, checksum)
    return b"\x78\x01" + stored + body + struct.pack(">I", checksum)


def test_the_bomb_is_what_it_says() -> None:
    small = zlib_bomb(4 << 20)
    assert len(zlib.decompress(small)) == (4 << 20) + len(b'<html><meta charset="zlib"><body>')
    assert b'<meta charset="zlib">' in small[:100]


async def _upload(
    world: World, caller: Caller, content: bytes, media_type: str = "text/html"
) -> httpx.Response:
    name = "page.html" if media_type == "text/html" else "notes.md"
    return await world.client.post(
        caller.path("/documents"),
        files={"file": (name, content, media_type)},
        data={"title": "Encodings"},
        headers=caller.headers,
    )


def _assert_mismatch(response: httpx.Response) -> None:
    assert response.status_code == 415, response.text
    assert response.json()["errorCode"] == "MEDIA_TYPE_MISMATCH", response.text


async def test_a_charset_bomb_neither_inflates_nor_stalls_another_tenants_search(
    world: World,
) -> None:
    bomb = zlib_bomb(_BOMB_INFLATED)
    assert len(bomb) < 2 << 20  # a small upload, well under the limit
    uploader = world.acme.caller("publish")
    searcher = world.globex.caller("search")
    done = asyncio.Event()
    latencies: list[float] = []

    async def search_meanwhile() -> None:
        while not done.is_set():
            started = time.monotonic()
            response = await world.search(searcher, {"principals": ["group:support"]})
            latencies.append(time.monotonic() - started)
            assert response.status_code == 200, response.text

    async def upload_bombs() -> list[httpx.Response]:
        try:
            return [await _upload(world, uploader, bomb) for _ in range(2)]
        finally:
            done.set()

    searching = asyncio.create_task(search_meanwhile())
    responses = await upload_bombs()
    await searching
    assert latencies
    assert max(latencies) < _SEARCH_BOUND_SECONDS, latencies
    for response in responses:
        _assert_mismatch(response)


# A PDF whose bytes are all ASCII: valid UTF-8, so only its header tells it from text.
ASCII_PDF = (
    b"%PDF-1.4\n1 0 obj\n<< /Type /Catalog /Pages 2 0 R >>\nendobj\n"
    b"2 0 obj\n<< /Type /Pages /Kids [] /Count 0 >>\nendobj\n"
    b"trailer\n<< /Root 1 0 R >>\n%%EOF\n"
)

_PAGE = "<p>hello world</p><p>second paragraph</p>"
# Each names a codec Python has that is no text encoding a document may use: bytes-to-bytes
# (hex, base64, bz2, uu_codec, zlib, quopri), text-to-text (rot13), one that decodes nothing
# (undefined), one that rewrites hostnames (punycode), one whose ASCII hides markup (utf-7),
# one WHATWG maps to the replacement encoding (iso-2022-kr) and one that is no label at all.
ODD_CHARSETS = [
    "hex",
    "base64",
    "bz2",
    "rot13",
    "rot_13",
    "uu_codec",
    "punycode",
    "undefined",
    "zlib",
    "quopri",
    "utf-7",
    "unicode_escape",
    "idna",
    "iso-2022-kr",
    "no-such-charset",
]


def _page(charset: str, *, http_equiv: bool = False) -> bytes:
    meta = (
        f'<meta http-equiv="Content-Type" content="text/html; charset={charset}">'
        if http_equiv
        else f'<meta charset="{charset}">'
    )
    return f"<html><head>{meta}</head><body>{_PAGE}</body></html>".encode()


@pytest.mark.parametrize("http_equiv", [False, True], ids=["meta-charset", "http-equiv"])
@pytest.mark.parametrize("charset", ODD_CHARSETS)
async def test_an_odd_charset_is_415_not_500(world: World, charset: str, http_equiv: bool) -> None:
    page = _page(charset, http_equiv=http_equiv)
    response = await _upload(world, world.acme.caller("publish"), page)
    _assert_mismatch(response)
    assert charset.lower() in response.json()["detail"].lower()


async def test_utf7_markup_is_refused(world: World) -> None:
    # What the finding showed: the bytes hold no "<script>", their UTF-7 decode does.
    hidden = b'<meta charset="utf-7"><body>+ADw-script+AD4-alert(1)+ADw-/script+AD4-</body>'
    assert "<script>" in hidden.decode("utf-7")
    _assert_mismatch(await _upload(world, world.acme.caller("publish"), hidden))


async def test_a_whatwg_charset_is_still_read(world: World) -> None:
    for charset, text in (("windows-1252", "café"), ("shift_jis", "日本語"), ("latin1", "Grüße")):
        page = f'<meta charset="{charset}"><p>{text}</p>'.encode(
            "cp932" if charset == "shift_jis" else "cp1252"
        )
        response = await _upload(world, world.acme.caller("publish"), page)
        assert response.status_code == 201, (charset, response.text)


async def _bulk(world: World, caller: Caller, files: list[tuple[str, bytes, str]]) -> Any:
    items = [{"title": f"Item {n}", "acl": {"read": ["group:support"]}} for n in range(len(files))]
    parts: list[tuple[str, Any]] = [("items", (None, json.dumps(items), "application/json"))]
    parts += [("file", file) for file in files]
    response = await world.client.post(
        caller.path("/documents/bulk"), files=parts, headers=caller.headers
    )
    assert response.status_code == 200, response.text
    return response.json()


async def test_in_bulk_each_odd_charset_is_refused_alone(world: World) -> None:
    good = ("good.html", _page("utf-8"), "text/html")
    files = [good]
    for charset in ODD_CHARSETS:
        files += [(f"{charset}.html", _page(charset), "text/html"), good]
    body = await _bulk(world, world.acme.caller("publish"), files)
    expected = [(202, None)] + [(415, "MEDIA_TYPE_MISMATCH"), (202, None)] * len(ODD_CHARSETS)
    assert [(r["status"], r.get("errorCode")) for r in body["results"]] == expected
    assert (body["published"], body["refused"]) == (len(ODD_CHARSETS) + 1, len(ODD_CHARSETS))


async def test_a_new_version_with_an_odd_charset_is_415(world: World) -> None:
    caller = world.acme.caller("publish")
    created = await _upload(world, caller, _page("utf-8"))
    assert created.status_code == 201, created.text
    document_id = created.json()["documentId"]
    response = await world.client.post(
        caller.path(f"/documents/{document_id}/versions"),
        files={"file": ("page.html", _page("hex"), "text/html")},
        headers=caller.headers,
    )
    _assert_mismatch(response)


@pytest.mark.parametrize(
    ("media_type", "content"),
    [
        ("text/markdown", ASCII_PDF),
        ("text/markdown", make_pdf()),
        ("text/plain", make_pdf()),
        ("text/html", make_pdf()),
        ("text/plain", b"plain words\x00\x00\x00\x01\x02 more words"),
        ("text/markdown", "# Title\n\nUTF-16 without its mark".encode("utf-16-le")),
        ("text/plain", bytes(range(1, 9)) * 64 + b"a few words"),
        ("text/plain", b"PK\x03\x04" + b"x" * 64),
    ],
    ids=[
        "ascii-pdf-as-markdown",
        "pdf-as-markdown",
        "pdf-as-text",
        "pdf-as-html",
        "nul",
        "utf16-no-bom",
        "controls",
        "zip",
    ],
)
async def test_binary_under_a_text_type_is_415(
    world: World, media_type: str, content: bytes
) -> None:
    _assert_mismatch(await _upload(world, world.acme.caller("publish"), content, media_type))
