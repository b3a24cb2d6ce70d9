"""The media types kb-pipeline indexes, and how a declared type is normalised.

The publisher refuses anything else at upload (415); the indexer's parsers are chosen by the
same names, so what is accepted is exactly what can be parsed.
"""

from __future__ import annotations

import codecs
import io
import re
import zipfile
from typing import Final

from services.runtime.errors import UnsupportedMediaType

TEXT: Final = "text/plain"
MARKDOWN: Final = "text/markdown"
HTML: Final = "text/html"
PDF: Final = "application/pdf"
DOCX: Final = "application/vnd.openxmlformats-officedocument.wordprocessingml.document"

SUPPORTED_MEDIA_TYPES: Final = frozenset({TEXT, MARKDOWN, HTML, PDF, DOCX})

# Clients often send a file without a precise type; its extension then decides.
BY_EXTENSION: Final = {
    ".txt": TEXT,
    ".text": TEXT,
    ".md": MARKDOWN,
    ".markdown": MARKDOWN,
    ".html": HTML,
    ".htm": HTML,
    ".pdf": PDF,
    ".docx": DOCX,
}
_UNSPECIFIC: Final = frozenset({"", "application/octet-stream", "binary/octet-stream"})
_ALIASES: Final = {"text/x-markdown": MARKDOWN}


def normalise_media_type(declared: str | None, filename: str | None = None) -> str:
    """``declared`` without parameters, lower-cased, aliases resolved; an unspecific type
    is decided by the file name's extension. The result may still be unsupported."""
    media_type = (declared or "").split(";", 1)[0].strip().lower()
    media_type = _ALIASES.get(media_type, media_type)
    if media_type in _UNSPECIFIC and filename:
        dot = filename.rfind(".")
        media_type = BY_EXTENSION.get(filename[dot:].lower(), media_type) if dot >= 0 else ""
    return media_type


def is_supported(media_type: str) -> bool:
    return media_type in SUPPORTED_MEDIA_TYPES


# --- do the bytes match the declared type? --------------------------------------------------
# Checked at upload so that a file stored as one type is never another (HTML stored as
# application/pdf): the publisher answers 415 and stores nothing. Only cheap structural
# checks, never a parse: the magic of a PDF, the central directory of a DOCX (no member is
# decompressed), a strict decode of text.

MEDIA_TYPE_MISMATCH: Final = "MEDIA_TYPE_MISMATCH"

_PDF_MAGIC: Final = b"%PDF-"
# Readers accept the header anywhere in the first 1024 bytes (PDF 1.7, implementation note
# 13); only whitespace and a byte-order mark may precede it here, so that a page of HTML
# that merely mentions "%PDF-" is still not a PDF.
_PDF_HEADER_WINDOW: Final = 1024
_PDF_LEADING: Final = b"\x00\t\n\x0c\r \xef\xbb\xbf\xfe\xff"
_DOCX_PARTS: Final = ("[Content_Types].xml", "word/document.xml")
# Longest first: the UTF-32 LE mark begins with the UTF-16 LE one. The indexer decodes text by
# the same marks, so what passes here is what it can read.
TEXT_BOMS: Final = (
    (codecs.BOM_UTF32_LE, "utf-32-le"),
    (codecs.BOM_UTF32_BE, "utf-32-be"),
    (codecs.BOM_UTF8, "utf-8"),
    (codecs.BOM_UTF16_LE, "utf-16-le"),
    (codecs.BOM_UTF16_BE, "utf-16-be"),
)
_META_CHARSET: Final = re.compile(rb"""<meta[^>]+charset\s*=\s*["']?\s*([A-Za-z0-9_.:-]+)""", re.I)
# Decoded in slices: a 50 MB text is checked without holding its decoded copy.
_DECODE_SLICE: Final = 1 << 20


def bom_encoding(content: bytes) -> tuple[str, int] | None:
    """The encoding a byte-order mark announces, and the mark's length."""
    for bom, encoding in TEXT_BOMS:
        if content.startswith(bom):
            return encoding, len(bom)
    return None


def declared_charset(declared: str | None) -> str | None:
    """The ``charset`` parameter of a declared media type, lower-cased, if any."""
    for parameter in (declared or "").split(";")[1:]:
        name, _, value = parameter.partition("=")
        if name.strip().lower() == "charset" and value.strip().strip('"').strip():
            return value.strip().strip('"').strip().lower()
    return None


def _mismatch(message: str) -> UnsupportedMediaType:
    return UnsupportedMediaType(message, code=MEDIA_TYPE_MISMATCH)


def _check_pdf(content: bytes) -> None:
    start = content.find(_PDF_MAGIC, 0, _PDF_HEADER_WINDOW + len(_PDF_MAGIC))
    if start < 0 or content[:start].strip(_PDF_LEADING):
        raise _mismatch(f"declared {PDF} but the file does not start with the PDF header")


def _check_docx(content: bytes) -> None:
    try:
        # Reads the central directory only; no member is opened or decompressed.
        with zipfile.ZipFile(io.BytesIO(content)) as archive:
            names = set(archive.namelist())
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError, EOFError):
        raise _mismatch(f"declared {DOCX} but the file is not a zip archive") from None
    missing = [part for part in _DOCX_PARTS if part not in names]
    if missing:
        raise _mismatch(
            f"declared {DOCX} but the archive has no {', '.join(missing)}: not a Word document"
        )


def _text_encoding(media_type: str, content: bytes, charset: str | None) -> tuple[str, int]:
    """The encoding the text is read in and how many leading bytes (a BOM) to skip: the
    indexer's rules exactly (a BOM first, HTML's ``<meta charset>``, else UTF-8). A declared
    ``charset`` parameter is not among them: the indexer never sees it (only the bare media
    type is stored), so text it cannot read must be refused here, not fail later."""
    found = bom_encoding(content)
    if found is not None:
        return found
    if media_type == HTML:
        meta = _META_CHARSET.search(content[:4096])
        if meta is not None:
            encoding = meta.group(1).decode("ascii").lower()
            # A document that can declare its charset in ASCII is not UTF-16 (HTML spec).
            return ("utf-8" if encoding.startswith(("utf-16", "utf-32")) else encoding), 0
    return "utf-8", 0


def _check_text(media_type: str, content: bytes, charset: str | None) -> None:
    encoding, skip = _text_encoding(media_type, content, charset)
    hint = (
        f"; the declared charset {charset!r} is not used: send UTF-8 (or start with a "
        "byte-order mark)"
        if charset and codecs.lookup(encoding).name != _codec_name(charset)
        else ""
    )
    try:
        decoder = codecs.getincrementaldecoder(encoding)(errors="strict")
    except LookupError:
        raise _mismatch(f"unknown text encoding {encoding!r}") from None
    view = memoryview(content)[skip:]
    try:
        for start in range(0, len(view), _DECODE_SLICE):
            decoder.decode(view[start : start + _DECODE_SLICE])
        decoder.decode(b"", final=True)
    except UnicodeDecodeError as error:
        raise _mismatch(
            f"declared {media_type} but the file is not valid {encoding} text "
            f"({error.reason}){hint}"
        ) from None


def _codec_name(charset: str) -> str | None:
    try:
        return codecs.lookup(charset).name
    except LookupError:
        return None


def check_content(media_type: str, content: bytes, *, charset: str | None = None) -> None:
    """Nothing when ``content`` can be what ``media_type`` (a supported, normalised type)
    says, else UnsupportedMediaType with code MEDIA_TYPE_MISMATCH. ``charset`` is the
    declared charset parameter of a text type."""
    if media_type == PDF:
        _check_pdf(content)
    elif media_type == DOCX:
        _check_docx(content)
    elif media_type in (TEXT, MARKDOWN, HTML):
        _check_text(media_type, content, charset)
