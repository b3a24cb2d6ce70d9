"""The indexer reads HTML by the publisher's allow-list of text encodings (issue 41): a page
with a charset that is no text encoding (one that somehow got past the upload check) ends
DOCUMENT_PARSE_FAILED, terminal, and is never decoded with that codec."""

from __future__ import annotations

import codecs

import pytest

from services.indexer.pipeline.parsing import parse_document
from services.indexer.task import ErrorCode, IndexingFailed
from services.runtime.indexing.index_failures import TERMINAL_CODES
from services.runtime.indexing.media_types import HTML, TEXT
from services.runtime.indexing.text_encodings import TEXT_CODECS

# bytes.decode refuses the bytes-to-bytes codecs by itself; UTF-7, the escape codecs and
# punycode (quadratic on a crafted page) it would run.
ODD = [
    "zlib",
    "bz2",
    "hex",
    "rot13",
    "punycode",
    "undefined",
    "utf-7",
    "unicode_escape",
    "raw_unicode_escape",
    "idna",
]


def _page(charset: str) -> bytes:
    return f'<html><head><meta charset="{charset}"></head><body><p>hello</p></body></html>'.encode()


@pytest.mark.parametrize("charset", ODD)
def test_a_page_naming_another_codec_fails_terminally(charset: str) -> None:
    with pytest.raises(IndexingFailed) as failed:
        parse_document(HTML, _page(charset))
    assert failed.value.code == ErrorCode.DOCUMENT_PARSE_FAILED
    assert failed.value.code in TERMINAL_CODES
    assert not failed.value.retriable
    assert f"charset {charset!r}, which is not a text encoding" in failed.value.message


@pytest.mark.parametrize(
    ("charset", "python_codec", "text"),
    [
        ("shift_jis", "cp932", "日本語"),
        ("euc-kr", "cp949", "한국어"),
        ("gbk", "gb18030", "中文"),
        ("latin1", "cp1252", "café €5"),
        ("koi8-r", "koi8_r", "Привет"),
        ("iso-2022-jp", "iso2022_jp", "日本語"),
    ],
)
def test_whatwg_charsets_are_read(charset: str, python_codec: str, text: str) -> None:
    page = f'<meta charset="{charset}"><body><p>{text}</p></body>'.encode(python_codec)
    sections = parse_document(HTML, page)
    assert [section.text for section in sections] == [text]


def test_a_page_declaring_utf16_in_ascii_is_utf8() -> None:
    page = '<meta charset="utf-16"><body><p>café</p></body>'.encode()
    assert [section.text for section in parse_document(HTML, page)] == ["café"]


def test_text_decodes_only_with_allowed_codecs() -> None:
    # The text readers' codecs (BOM or UTF-8) are on the list the HTML reader uses.
    assert {"utf-8", "utf-16-le", "utf-16-be", "utf-32-le", "utf-32-be"} <= TEXT_CODECS
    assert parse_document(TEXT, codecs.BOM_UTF32_BE + "hello".encode("utf-32-be"))
