"""The encodings text is read in: an allow-list, never whatever codec a document names.

Python's codec registry holds more than text encodings: bytes-to-bytes codecs (``zlib``,
``bz2``, ``base64``, ``hex``), text-to-text ones (``rot13``), ``punycode``, ``undefined``,
``utf-7`` (whose ASCII hides markup: ``+ADw-script+AD4-``). A ``<meta charset="zlib">``
once inflated an upload a thousandfold. So a label is looked up here and only here:

- a byte-order mark decides first: UTF-8, UTF-16 or UTF-32;
- else the labels of the WHATWG Encoding Standard (what HTML may name), mapped to the Python
  codec that decodes them; the labels of its "replacement" encoding and anything else are
  refused, not ignored (a page that names an encoding we do not read is not guessed at);
  windows-874 and windows-125x are read as WHATWG defines them (bytes Python leaves
  undefined in 0x80-0x9F are C1 controls), not as Python's stricter cp125x;
- HTML's own rules on top: a page that names UTF-16 or UTF-32 in ASCII is not UTF-16 or
  UTF-32 but UTF-8, and ``x-user-defined`` is windows-1252;
- without either, UTF-8.

Every codec here decodes at most one character per byte, so decoded text is never longer
(in characters) than its bytes: no codec that inflates. ``decoded_pieces`` checks that too.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Callable, Iterator
from typing import Final

from services.runtime.errors import UnsupportedMediaType

MEDIA_TYPE_MISMATCH: Final = "MEDIA_TYPE_MISMATCH"
UTF8: Final = "utf-8"

# Longest first: the UTF-32 LE mark begins with the UTF-16 LE one.
TEXT_BOMS: Final = (
    (codecs.BOM_UTF32_LE, "utf-32-le"),
    (codecs.BOM_UTF32_BE, "utf-32-be"),
    (codecs.BOM_UTF8, UTF8),
    (codecs.BOM_UTF16_LE, "utf-16-le"),
    (codecs.BOM_UTF16_BE, "utf-16-be"),
)

# https://encoding.spec.whatwg.org/#names-and-labels: each Python codec with its labels.
# GBK is read by the gb18030 decoder, Big5 as HKSCS, Shift_JIS as windows-31j and EUC-KR as
# windows-949, as the standard defines them.
_LABELS_BY_CODEC: Final[dict[str, str]] = {
    UTF8: "unicode-1-1-utf-8 unicode11utf8 unicode20utf8 utf-8 utf8 x-unicode20utf8",
    "cp866": "866 cp866 csibm866 ibm866",
    "iso8859_2": "csisolatin2 iso-8859-2 iso-ir-101 iso8859-2 iso88592 iso_8859-2 "
    "iso_8859-2:1987 l2 latin2",
    "iso8859_3": "csisolatin3 iso-8859-3 iso-ir-109 iso8859-3 iso88593 iso_8859-3 "
    "iso_8859-3:1988 l3 latin3",
    "iso8859_4": "csisolatin4 iso-8859-4 iso-ir-110 iso8859-4 iso88594 iso_8859-4 "
    "iso_8859-4:1988 l4 latin4",
    "iso8859_5": "csisolatincyrillic cyrillic iso-8859-5 iso-ir-144 iso8859-5 iso88595 "
    "iso_8859-5 iso_8859-5:1988",
    "iso8859_6": "arabic asmo-708 csiso88596e csiso88596i csisolatinarabic ecma-114 "
    "iso-8859-6 iso-8859-6-e iso-8859-6-i iso-ir-127 iso8859-6 iso88596 iso_8859-6 "
    "iso_8859-6:1987",
    "iso8859_7": "csisolatingreek ecma-118 elot_928 greek greek8 iso-8859-7 iso-ir-126 "
    "iso8859-7 iso88597 iso_8859-7 iso_8859-7:1987 sun_eu_greek",
    "iso8859_8": "csiso88598e csisolatinhebrew hebrew iso-8859-8 iso-8859-8-e iso-ir-138 "
    "iso8859-8 iso88598 iso_8859-8 iso_8859-8:1988 visual csiso88598i iso-8859-8-i logical",
    "iso8859_10": "csisolatin6 iso-8859-10 iso-ir-157 iso8859-10 iso885910 l6 latin6",
    "iso8859_13": "iso-8859-13 iso8859-13 iso885913",
    "iso8859_14": "iso-8859-14 iso8859-14 iso885914",
    "iso8859_15": "csisolatin9 iso-8859-15 iso8859-15 iso885915 iso_8859-15 l9",
    "iso8859_16": "iso-8859-16",
    "koi8_r": "cskoi8r koi koi8 koi8-r koi8_r",
    "koi8_u": "koi8-ru koi8-u",
    "mac_roman": "csmacintosh mac macintosh x-mac-roman",
    "cp874": "dos-874 iso-8859-11 iso8859-11 iso885911 tis-620 windows-874",
    "cp1250": "cp1250 windows-1250 x-cp1250",
    "cp1251": "cp1251 windows-1251 x-cp1251",
    "cp1252": "ansi_x3.4-1968 ascii cp1252 cp819 csisolatin1 ibm819 iso-8859-1 iso-ir-100 "
    "iso8859-1 iso88591 iso_8859-1 iso_8859-1:1987 l1 latin1 us-ascii windows-1252 x-cp1252",
    "cp1253": "cp1253 windows-1253 x-cp1253",
    "cp1254": "cp1254 csisolatin5 iso-8859-9 iso-ir-148 iso8859-9 iso88599 iso_8859-9 "
    "iso_8859-9:1989 l5 latin5 windows-1254 x-cp1254",
    "cp1255": "cp1255 windows-1255 x-cp1255",
    "cp1256": "cp1256 windows-1256 x-cp1256",
    "cp1257": "cp1257 windows-1257 x-cp1257",
    "cp1258": "cp1258 windows-1258 x-cp1258",
    "mac_cyrillic": "x-mac-cyrillic x-mac-ukrainian",
    "gb18030": "chinese csgb2312 csiso58gb231280 gb2312 gb_2312 gb_2312-80 gbk iso-ir-58 "
    "x-gbk gb18030",
    "big5hkscs": "big5 big5-hkscs cn-big5 csbig5 x-x-big5",
    "euc_jp": "cseucpkdfmtjapanese euc-jp x-euc-jp",
    "iso2022_jp": "csiso2022jp iso-2022-jp",
    "cp932": "csshiftjis ms932 ms_kanji shift-jis shift_jis sjis windows-31j x-sjis",
    "cp949": "cseuckr csksc56011987 euc-kr iso-ir-149 korean ks_c_5601-1987 ks_c_5601-1989 "
    "ksc5601 ksc_5601 windows-949",
    "utf-16-be": "unicodefffe utf-16be",
    "utf-16-le": "csunicode iso-10646-ucs-2 ucs-2 unicode unicodefeff utf-16 utf-16le",
}
WHATWG_LABELS: Final[dict[str, str]] = {
    label: codec for codec, labels in _LABELS_BY_CODEC.items() for label in labels.split()
}
# The codecs text is ever decoded with: the labels' and the byte-order marks'.
TEXT_CODECS: Final = frozenset(WHATWG_LABELS.values()) | {codec for _, codec in TEXT_BOMS}

# WHATWG's windows-874 and windows-125x (which ``iso-8859-1``, ``latin1``, ``us-ascii`` and
# ``iso-8859-9`` name too) decode each byte 0x80-0x9F that Microsoft left unassigned as the
# C1 control of the same number (0x81 is U+0081), as browsers always have; Python's cp125x
# raise on them, which refused pages that were read before. These codecs are read through
# tables built once from Python's with those holes filled; their other holes (cp1253's
# 0xAA, cp874's 0xDB) are holes in WHATWG's tables too and stay errors.
_UNDEFINED: Final = "\ufffe"  # what charmap_decode reads as "no character"


def _whatwg_table(codec: str) -> str:
    characters = []
    for byte in range(256):
        try:
            characters.append(bytes([byte]).decode(codec))
        except UnicodeDecodeError:
            characters.append(chr(byte) if 0x80 <= byte <= 0x9F else _UNDEFINED)
    return "".join(characters)


_WHATWG_TABLES: Final[dict[str, str]] = {
    codec: _whatwg_table(codec) for codec in ("cp874", *(f"cp{page}" for page in range(1250, 1259)))
}


def _table_decode(content: bytes | memoryview, codec: str, table: str) -> str:
    try:
        return codecs.charmap_decode(content, "strict", table)[0]
    except UnicodeDecodeError as error:  # named "charmap": name the codec instead
        raise UnicodeDecodeError(
            codec, error.object, error.start, error.end, error.reason
        ) from None


# Only the start of a page is searched for its declaration, as browsers do.
_PRESCAN_BYTES: Final = 4096
# Labels are ASCII letters, digits and ``_.:-``; a longer run than any label is cut (and then
# refused as no label), so what a message echoes stays short.
_META_CHARSET: Final = re.compile(
    rb"""<meta[^>]+charset\s*=\s*["']?\s*([A-Za-z0-9_.:-]{1,40})""", re.I
)
# Decoded in slices: a large text is checked without holding its decoded copy, and a worker
# thread decoding it gives the GIL back between slices.
DECODE_SLICE: Final = 1 << 18


def mismatch(message: str) -> UnsupportedMediaType:
    return UnsupportedMediaType(message, code=MEDIA_TYPE_MISMATCH)


def bom_encoding(content: bytes) -> tuple[str, int] | None:
    """The encoding a byte-order mark announces, and the mark's length."""
    for bom, encoding in TEXT_BOMS:
        if content.startswith(bom):
            return encoding, len(bom)
    return None


def text_codec(label: str) -> str | None:
    """The Python codec a WHATWG label names (case and surrounding whitespace aside), or
    None: the label is not a text encoding that is read."""
    return WHATWG_LABELS.get(label.strip(" \t\n\f\r").lower())


def declared_html_label(content: bytes) -> str | None:
    """The charset a page declares near its top (``<meta charset>`` or ``http-equiv``
    Content-Type), lower-cased, as written."""
    found = _META_CHARSET.search(content[:_PRESCAN_BYTES])
    return found.group(1).decode("ascii").lower() if found else None


def html_encoding(content: bytes) -> tuple[str, int]:
    """The codec an HTML page is read in and how many leading bytes (its BOM) to skip; a
    declared label that is not a text encoding read here is UnsupportedMediaType
    (MEDIA_TYPE_MISMATCH)."""
    found = bom_encoding(content)
    if found is not None:
        return found
    label = declared_html_label(content)
    if label is None:
        return UTF8, 0
    # A page that can declare its charset in ASCII is not UTF-16 (or UTF-32).
    if label.startswith(("utf-16", "utf-32")):
        return UTF8, 0
    if label == "x-user-defined":
        return "cp1252", 0
    codec = text_codec(label)
    if codec is None:
        raise mismatch(
            f"the page declares charset {label!r}, which is not a text encoding that is read: "
            "use UTF-8 (or another WHATWG Encoding Standard label; never UTF-7 or a codec "
            "that transforms bytes)"
        )
    return (UTF8 if codec.startswith("utf-16") else codec), 0


def plain_encoding(content: bytes) -> tuple[str, int]:
    """Plain text and Markdown: by byte-order mark, else UTF-8; nothing is guessed."""
    return bom_encoding(content) or (UTF8, 0)


def _checked(codec: str) -> str:
    if codec not in TEXT_CODECS:
        raise mismatch(f"{codec!r} is not a text encoding that is read")
    return codec


def _slice_decoder(codec: str) -> Callable[[bytes, bool], str]:
    """Decodes consecutive slices (the second argument: the last one)."""
    table = _WHATWG_TABLES.get(codec)
    if table is None:
        return codecs.getincrementaldecoder(codec)(errors="strict").decode
    # A table decodes byte by byte: a slice needs nothing of the one before.
    return lambda piece, _final: _table_decode(piece, codec, table)


def decoded_pieces(content: bytes, codec: str, *, skip: int = 0) -> Iterator[str]:
    """``content[skip:]`` decoded strictly in slices. Raises UnicodeDecodeError on bytes
    that are not ``codec`` text, and UnsupportedMediaType for a codec not in TEXT_CODECS
    (never looked up) or text longer than its bytes (no codec here does that)."""
    decode = _slice_decoder(_checked(codec))
    consumed = produced = 0
    for start in range(skip, len(content), DECODE_SLICE):
        piece = content[start : start + DECODE_SLICE]
        text = decode(piece, False)
        consumed += len(piece)
        produced += len(text)
        if produced > consumed:
            raise mismatch(f"{codec} decoded to more characters than bytes")
        yield text
    yield decode(b"", True)


def decode_all(content: bytes, codec: str, *, skip: int = 0) -> str:
    """``content[skip:]`` decoded strictly at once, for readers that need the whole text.
    Raises as ``decoded_pieces`` does; its UnicodeDecodeError counts from ``skip``."""
    table = _WHATWG_TABLES.get(_checked(codec))
    if table is not None:
        return _table_decode(memoryview(content)[skip:], codec, table)
    return content[skip:].decode(codec)
