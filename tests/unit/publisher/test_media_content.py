"""The bytes of an upload against its declared type
(services.runtime.indexing.media_types.check_content).

A mismatch is 415 MEDIA_TYPE_MISMATCH: HTML stored as a PDF, a zip that is no Word document,
text that does not decode. Only structure is checked, never a parse.
"""

from __future__ import annotations

import codecs

import pytest

from services.publisher.domain import Upload, check_upload
from services.runtime.errors import UnsupportedMediaType
from services.runtime.indexing.media_types import (
    DOCX,
    HTML,
    MARKDOWN,
    MEDIA_TYPE_MISMATCH,
    PDF,
    TEXT,
    check_content,
    declared_charset,
)
from tests.support.documents import (
    make_corrupt_pdf,
    make_docx,
    make_docx_zip_bomb,
    make_html,
    make_markdown,
    make_pdf,
    make_text,
    make_zip_not_docx,
)


@pytest.mark.parametrize(
    ("media_type", "content"),
    [
        (PDF, make_pdf()),
        (PDF, b"%PDF-1.7\n"),
        (PDF, codecs.BOM_UTF8 + b"\r\n  %PDF-1.4\n"),  # whitespace and a BOM may lead
        (PDF, b"\n" * 1000 + b"%PDF-1.4\n"),
        (PDF, make_corrupt_pdf()),  # the header is right: the parser decides the rest
        (DOCX, make_docx()),
        (DOCX, make_docx_zip_bomb(1024 * 1024)),  # structure only: nothing is decompressed
        (TEXT, make_text(["Grüße, 30 días."])),
        (TEXT, make_text(["utf-16 with its mark"], encoding="utf-16")),
        (MARKDOWN, make_markdown()),
        (HTML, make_html()),
        (HTML, b'<meta charset="windows-1252"><p>caf\xe9</p>'),  # HTML declares its own
    ],
)
def test_bytes_that_are_their_type_pass(media_type: str, content: bytes) -> None:
    check_content(media_type, content)


@pytest.mark.parametrize(
    ("media_type", "content"),
    [
        (PDF, make_html()),
        (PDF, b""),
        (PDF, b"%PDF"),
        (PDF, b"<html>%PDF-1.7</html>"),  # mentioning the header is not having it
        (PDF, b" " * 1100 + b"%PDF-1.7\n"),  # past the first 1024 bytes
        (PDF, make_docx()),
        (DOCX, make_pdf()),
        (DOCX, make_zip_not_docx()),
        (DOCX, b"PK\x03\x04 truncated"),
        (DOCX, make_html()),
        (TEXT, b"caf\xe9"),
        (TEXT, b"\xff\xfe\x00"),  # a UTF-16 mark, then an odd byte
        (MARKDOWN, b"# Title\n\x80"),
        (HTML, b"<p>caf\xe9</p>"),
        (TEXT, make_pdf()),
        (TEXT, b"\x00"),  # valid UTF-8, but NUL is never text (issue 41)
    ],
)
def test_bytes_that_are_not_their_type_are_415(media_type: str, content: bytes) -> None:
    with pytest.raises(UnsupportedMediaType) as caught:
        check_content(media_type, content)
    assert caught.value.code == MEDIA_TYPE_MISMATCH
    assert caught.value.http_status == 415


def test_text_is_checked_as_the_indexer_reads_it_whatever_charset_is_declared() -> None:
    # The indexer reads text by its byte-order mark or as UTF-8 (only the bare media type is
    # stored): Latin-1 accepted here would fail indexing later, so it is refused now, and
    # the message says what to send instead.
    latin = "café".encode("latin-1")
    with pytest.raises(UnsupportedMediaType) as caught:
        check_content(TEXT, latin, charset="iso-8859-1")
    assert caught.value.code == MEDIA_TYPE_MISMATCH
    assert "'iso-8859-1' is not used: send UTF-8" in caught.value.message
    with pytest.raises(UnsupportedMediaType):
        check_content(TEXT, latin)
    # A charset the indexer's rules agree with changes nothing; an unknown one is ignored.
    check_content(TEXT, "café".encode(), charset="utf-8")
    check_content(TEXT, b"x", charset="no-such-charset")
    check_content(TEXT, codecs.BOM_UTF16_LE + "café".encode("utf-16-le"), charset="latin-1")


@pytest.mark.parametrize(
    ("declared", "charset"),
    [
        ("text/plain; charset=ISO-8859-1", "iso-8859-1"),
        ('text/plain;charset="utf-8"', "utf-8"),
        ("text/plain; format=flowed", None),
        ("text/plain; charset=", None),
        ("text/plain", None),
        (None, None),
    ],
)
def test_declared_charset(declared: str | None, charset: str | None) -> None:
    assert declared_charset(declared) == charset


def test_upload_checks_the_bytes_against_the_declared_type() -> None:
    with pytest.raises(UnsupportedMediaType) as caught:
        check_upload(Upload(make_html(), "application/pdf", "a.pdf"), 1 << 20)
    assert caught.value.code == MEDIA_TYPE_MISMATCH
    # The type decided by the extension is checked as a declared one is.
    with pytest.raises(UnsupportedMediaType):
        check_upload(Upload(b"plain", "application/octet-stream", "a.docx"), 1 << 20)
    latin = Upload("café".encode("latin-1"), "text/plain; charset=latin-1", "a.txt")
    with pytest.raises(UnsupportedMediaType):
        check_upload(latin, 1 << 20)
    utf8 = Upload("café".encode(), "text/plain; charset=utf-8", "a.txt")
    assert check_upload(utf8, 1 << 20) == TEXT
