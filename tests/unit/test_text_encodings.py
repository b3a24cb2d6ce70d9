"""Text is read only in text encodings (issue 41): the allow-list of
services.runtime.indexing.text_encodings and the upload check built on it
(services.runtime.indexing.media_types.check_content)."""

from __future__ import annotations

import codecs
import random
from typing import Any

import pytest

from services.runtime.errors import UnsupportedMediaType
from services.runtime.indexing import text_encodings
from services.runtime.indexing.media_types import HTML, MARKDOWN, TEXT, check_content
from services.runtime.indexing.text_encodings import (
    MEDIA_TYPE_MISMATCH,
    TEXT_CODECS,
    WHATWG_LABELS,
    decode_all,
    decoded_pieces,
    html_encoding,
    text_codec,
)

# Codecs Python has that are no text encoding a document may be read in.
NOT_TEXT = [
    "zlib",
    "zlib_codec",
    "bz2",
    "base64",
    "base_64",
    "hex",
    "uu_codec",
    "uu",
    "quopri",
    "rot13",
    "rot_13",
    "punycode",
    "undefined",
    "utf-7",
    "utf7",
    "unicode_escape",
    "raw_unicode_escape",
    "idna",
    "mbcs",
    "iso-2022-kr",  # WHATWG: the replacement encoding
    "hz-gb-2312",
    "replacement",
    "utf-32",  # no WHATWG label (read by its byte-order mark only)
    "no-such-charset",
    "",
]
# The ones an HTML page is refused for naming: an empty label is no declaration, and UTF-32
# named in ASCII is read as UTF-8 (HTML's rule).
HTML_REFUSED = [label for label in NOT_TEXT if label and label != "utf-32"]


@pytest.mark.parametrize("codec", sorted(TEXT_CODECS))
def test_every_allowed_codec_is_a_text_encoding(codec: str) -> None:
    info = codecs.lookup(codec)
    assert info._is_text_encoding
    assert info.name not in ("utf-7", "punycode", "idna")


@pytest.mark.parametrize("codec", sorted(TEXT_CODECS))
def test_no_allowed_codec_inflates(codec: str) -> None:
    # Whatever the bytes, never more characters than bytes: decoded text is bounded by the
    # upload (at most four bytes of memory a character).
    rng = random.Random(codec)
    for size in (1, 7, 100, 4096):
        data = bytes(rng.randrange(256) for _ in range(size))
        assert len(data.decode(codec, errors="replace")) <= size
    escapes = b"\x1b$B" + b"\x30\x21" * 50 + b"\x1b(B"  # ISO-2022-JP switches
    assert len(escapes.decode(codec, errors="replace")) <= len(escapes)


@pytest.mark.parametrize("label", NOT_TEXT)
def test_labels_of_other_codecs_are_not_text_encodings(label: str) -> None:
    assert text_codec(label) is None
    assert label not in WHATWG_LABELS


@pytest.mark.parametrize(
    ("label", "codec"),
    [
        ("UTF-8", "utf-8"),
        (" utf8 ", "utf-8"),
        ("latin1", "cp1252"),
        ("ISO-8859-1", "cp1252"),
        ("us-ascii", "cp1252"),
        ("iso-8859-2", "iso8859_2"),
        ("windows-1251", "cp1251"),
        ("koi8-r", "koi8_r"),
        ("shift_jis", "cp932"),
        ("euc-kr", "cp949"),
        ("gbk", "gb18030"),
        ("gb2312", "gb18030"),
        ("big5", "big5hkscs"),
        ("iso-2022-jp", "iso2022_jp"),
        ("utf-16", "utf-16-le"),
    ],
)
def test_whatwg_labels(label: str, codec: str) -> None:
    assert text_codec(label) == codec


@pytest.mark.parametrize(
    ("page", "expected"),
    [
        (b"<p>no declaration</p>", ("utf-8", 0)),
        (b'<meta charset="Shift_JIS">', ("cp932", 0)),
        (b"<meta charset=latin1>", ("cp1252", 0)),
        (b'<META HTTP-EQUIV="Content-Type" CONTENT="text/html; charset=koi8-r">', ("koi8_r", 0)),
        (b'<meta charset="utf-16">', ("utf-8", 0)),  # a page that says so in ASCII is not
        (b'<meta charset="utf-32le">', ("utf-8", 0)),
        (b'<meta charset="x-user-defined">', ("cp1252", 0)),
        (codecs.BOM_UTF16_LE + '<meta charset="zlib">'.encode("utf-16-le"), ("utf-16-le", 2)),
    ],
)
def test_html_encoding(page: bytes, expected: tuple[str, int]) -> None:
    assert html_encoding(page) == expected


@pytest.mark.parametrize("label", HTML_REFUSED)
@pytest.mark.parametrize(
    "template",
    [
        '<meta charset="{}">',
        "<meta charset={}>",
        "<meta http-equiv='content-type' content='text/html; charset={}'>",
    ],
)
def test_an_html_page_naming_another_codec_is_refused(label: str, template: str) -> None:
    page = (template.format(label) + "<p>hello</p>").encode()
    with pytest.raises(UnsupportedMediaType) as caught:
        html_encoding(page)
    assert caught.value.code == MEDIA_TYPE_MISMATCH
    assert repr(label) in caught.value.message


def test_a_long_label_is_cut_in_the_message() -> None:
    with pytest.raises(UnsupportedMediaType) as caught:
        html_encoding(b'<meta charset="' + b"x" * 5000 + b'">')
    assert len(caught.value.message) < 300


def test_only_allowed_codecs_are_ever_looked_up(monkeypatch: pytest.MonkeyPatch) -> None:
    looked_up: list[str] = []
    real = codecs.getincrementaldecoder

    def spy(name: str) -> Any:
        looked_up.append(name)
        return real(name)

    monkeypatch.setattr(codecs, "getincrementaldecoder", spy)
    for label in HTML_REFUSED:
        page = f'<meta charset="{label}"><p>hello</p>'.encode()
        with pytest.raises(UnsupportedMediaType):
            check_content(HTML, page)
    for codec in ("zlib", "hex", "utf-7", "rot13"):
        with pytest.raises(UnsupportedMediaType):
            list(decoded_pieces(b"x", codec))
        with pytest.raises(UnsupportedMediaType):
            decode_all(b"x", codec)
    assert set(looked_up) <= TEXT_CODECS


def test_decoding_in_slices_is_decoding_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(text_encodings, "DECODE_SLICE", 7)
    for codec, text in (
        ("utf-8", "Grüße, 日本語, 😀 "),
        ("utf-16-le", "Grüße, 日本語, 😀 "),
        ("cp932", "日本語のテキスト "),
        ("gb18030", "中文 😀 "),
    ):
        data = (text * 20).encode(codec)
        assert "".join(decoded_pieces(data, codec)) == text * 20
    with pytest.raises(UnicodeDecodeError):
        list(decoded_pieces("é".encode() * 10 + b"\xff", "utf-8"))


# --- the upload check ---------------------------------------------------------------------


def _refused(media_type: str, content: bytes) -> str:
    with pytest.raises(UnsupportedMediaType) as caught:
        check_content(media_type, content)
    assert caught.value.code == MEDIA_TYPE_MISMATCH
    assert caught.value.http_status == 415
    return caught.value.message


def test_a_charset_bomb_is_refused_by_its_label_without_inflating() -> None:
    import zlib

    page = b'<meta charset="zlib">'
    bomb = zlib.compress(page + b" " * (8 << 20), 9)
    # The label must be in the raw bytes for the page to claim it: a stored prefix does.
    assert "'zlib'" in _refused(HTML, page + bomb)


@pytest.mark.parametrize(
    ("media_type", "content", "says"),
    [
        (MARKDOWN, b"%PDF-1.4\n1 0 obj << /Type /Catalog >> endobj\n%%EOF\n", "is a PDF"),
        (TEXT, b"\n  %PDF-1.7\n", "is a PDF"),
        (HTML, b"PK\x03\x04rest of a zip", "zip archive"),
        (TEXT, b"words\x00words", "NUL"),
        (MARKDOWN, "# UTF-16 without its mark".encode("utf-16-le"), "NUL"),
        (TEXT, b"\x01\x02\x03\x04" + b"a" * 100, "control characters"),
        (TEXT, b"a" * 98 + b"\x1a\x1a", "control characters"),  # 2 in 100
        (TEXT, "text\u0085\u0086 and more".encode(), "control characters"),  # C1 in UTF-8
    ],
)
def test_binary_under_a_text_type_is_refused(media_type: str, content: bytes, says: str) -> None:
    assert says in _refused(media_type, content)


@pytest.mark.parametrize(
    ("media_type", "content"),
    [
        (TEXT, b"a" * 99 + b"\x1a"),  # a DOS end-of-file mark: 1 in 100
        (TEXT, b"\x1b[1mbold\x1b[0m and a bell\x07, a back\x08space\tand\x0bfeeds\x0c\r\n"),
        (MARKDOWN, b"# Notes\n\nThe %PDF-1.7 header starts a PDF.\n"),
        (HTML, codecs.BOM_UTF16_LE + "<p>zero bytes are UTF-16's</p>".encode("utf-16-le")),
        (HTML, '<meta charset="shift_jis"><p>日本語</p>'.encode("cp932")),
        (HTML, '<meta charset="iso-2022-jp"><p>日本語</p>'.encode("iso2022_jp")),
        (HTML, '<meta charset="euc-kr"><p>한국어</p>'.encode("cp949")),
        (HTML, '<meta charset="koi8-r"><p>Привет</p>'.encode("koi8_r")),
        (HTML, '<meta charset="utf-16"><p>café</p>'.encode()),
    ],
)
def test_text_passes(media_type: str, content: bytes) -> None:
    check_content(media_type, content)


def test_a_charset_parameter_naming_a_codec_is_only_a_hint() -> None:
    # The declared parameter is never used to decode (the indexer never sees it): UTF-8 is.
    check_content(TEXT, b"plain", charset="zlib")
    assert "'zlib' is not used" in _refused_with_charset(b"caf\xe9", "zlib")


def _refused_with_charset(content: bytes, charset: str) -> str:
    with pytest.raises(UnsupportedMediaType) as caught:
        check_content(TEXT, content, charset=charset)
    return caught.value.message


# --- WHATWG's windows-125x: bytes Python leaves undefined are C1 controls --------------------

# Python's cp1252 raises on these; WHATWG's windows-1252 (which iso-8859-1, latin1 and
# us-ascii name) decodes each as the C1 control of the same number, as browsers do.
CP1252_HOLES = [0x81, 0x8D, 0x8F, 0x90, 0x9D]


def _latin1_page(byte: int, label: str = "iso-8859-1") -> bytes:
    body = "café " * 40
    return f'<meta charset="{label}"><p>{body}</p>'.encode("cp1252") + bytes([byte])


@pytest.mark.parametrize("byte", CP1252_HOLES)
def test_an_iso_8859_1_page_with_an_undefined_cp1252_byte_is_read_as_whatwg_does(
    byte: int,
) -> None:
    page = _latin1_page(byte)
    codec, skip = html_encoding(page)
    assert codec == "cp1252"
    expected = page[:-1].decode("cp1252") + chr(byte)
    assert decode_all(page, codec, skip=skip) == expected
    assert "".join(decoded_pieces(page, codec, skip=skip)) == expected
    check_content(HTML, page)  # one control character among hundreds: text


@pytest.mark.parametrize("byte", [0x81, 0x8D, 0x8E, 0x8F, 0x90, 0x9D, 0x9E])
def test_an_iso_8859_9_page_with_an_undefined_cp1254_byte_is_read_as_whatwg_does(
    byte: int,
) -> None:
    page = _latin1_page(byte, "iso-8859-9")
    codec, skip = html_encoding(page)
    assert codec == "cp1254"
    assert decode_all(page, codec, skip=skip).endswith(chr(byte))
    assert "".join(decoded_pieces(page, codec, skip=skip)).endswith(chr(byte))
    check_content(HTML, page)


def test_the_c1_controls_of_windows_125x_still_count_as_binary() -> None:
    page = b'<meta charset="latin1">' + bytes(CP1252_HOLES) * 40
    assert "control characters" in _refused(HTML, page)


def test_whatwg_windows_125x_in_slices_is_whatwg_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(text_encodings, "DECODE_SLICE", 7)
    data = ("Grüße \u20ac ".encode("cp1252") + bytes(CP1252_HOLES)) * 20
    assert "".join(decoded_pieces(data, "cp1252", skip=3)) == decode_all(data, "cp1252", skip=3)


@pytest.mark.parametrize(
    ("codec", "byte"),
    [("cp1253", 0xAA), ("cp1253", 0xFF), ("cp1255", 0xCA), ("cp1257", 0xA1), ("cp874", 0xDB)],
)
def test_bytes_whatwg_leaves_undefined_stay_errors(codec: str, byte: int) -> None:
    # Only 0x80-0x9F are C1 controls in WHATWG's tables; its other holes are errors there too.
    data = b"text " + bytes([byte])
    with pytest.raises(UnicodeDecodeError) as at_once:
        decode_all(data, codec, skip=1)
    assert at_once.value.start == 4  # counted from skip
    with pytest.raises(UnicodeDecodeError):
        list(decoded_pieces(data, codec))
