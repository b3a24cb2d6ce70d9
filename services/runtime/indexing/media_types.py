"""The media types kb-pipeline indexes, and how a declared type is normalised.

The publisher refuses anything else at upload (415); the indexer's parsers are chosen by the
same names, so what is accepted is exactly what can be parsed.
"""

from __future__ import annotations

import asyncio
import codecs
import functools
import io
import re
import zipfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Final, ParamSpec, TypeVar

from services.runtime.indexing import text_encodings
from services.runtime.indexing.text_encodings import (
    decoded_pieces,
    html_encoding,
    mismatch,
    plain_encoding,
    text_codec,
)

_P = ParamSpec("_P")
_T = TypeVar("_T")

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
# decompressed), a strict decode of text in an allowed text encoding
# (services.runtime.indexing.text_encodings). The publisher runs them in a worker thread
# (``run_media_check``): a 25 MB text is decoded off the event loop.

MEDIA_TYPE_MISMATCH: Final = text_encodings.MEDIA_TYPE_MISMATCH

_PDF_MAGIC: Final = b"%PDF-"
# Readers accept the header anywhere in the first 1024 bytes (PDF 1.7, implementation note
# 13); only whitespace and a byte-order mark may precede it here, so that a page of HTML
# that merely mentions "%PDF-" is still not a PDF.
_PDF_HEADER_WINDOW: Final = 1024
_PDF_LEADING: Final = b"\x00\t\n\x0c\r \xef\xbb\xbf\xfe\xff"
_ZIP_MAGIC: Final = b"PK\x03\x04"
_DOCX_PARTS: Final = ("[Content_Types].xml", "word/document.xml")

# What makes bytes that decode "binary" rather than text, after decoding (so a UTF-16 page
# counts its characters, not its zero bytes). U+0000 at all: no text format uses it and
# PostgreSQL text cannot hold it. Beyond that, the controls file(1) does not take for text
# (C0 but TAB, LF, VT, FF, CR, BEL, BS and ESC; DEL; C1) may be at most 1 character in 100:
# a stray one (a DOS end-of-file mark, a DEL) is tolerated, a file made of them
# is not.
_BINARY_CONTROLS: Final = re.compile("[\x00-\x06\x0e-\x1a\x1c-\x1f\x7f-\x9f]")
_MAX_CONTROLS_PER_100: Final = 1
# At most this many checks decode at once: each is CPU-bound and holds the GIL between its
# slices, so more threads would only take more of it from the event loop.
_CHECK_THREADS: Final = 2
_checks = ThreadPoolExecutor(max_workers=_CHECK_THREADS, thread_name_prefix="media-check")


def declared_charset(declared: str | None) -> str | None:
    """The ``charset`` parameter of a declared media type, lower-cased, if any."""
    for parameter in (declared or "").split(";")[1:]:
        name, _, value = parameter.partition("=")
        if name.strip().lower() == "charset" and value.strip().strip('"').strip():
            return value.strip().strip('"').strip().lower()
    return None


def _pdf_header_at(content: bytes) -> bool:
    start = content.find(_PDF_MAGIC, 0, _PDF_HEADER_WINDOW + len(_PDF_MAGIC))
    return start >= 0 and not content[:start].strip(_PDF_LEADING)


def _check_pdf(content: bytes) -> None:
    if not _pdf_header_at(content):
        raise mismatch(f"declared {PDF} but the file does not start with the PDF header")


def _check_docx(content: bytes) -> None:
    try:
        # Reads the central directory only; no member is opened or decompressed.
        with zipfile.ZipFile(io.BytesIO(content)) as archive:
            names = set(archive.namelist())
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError, EOFError):
        raise mismatch(f"declared {DOCX} but the file is not a zip archive") from None
    missing = [part for part in _DOCX_PARTS if part not in names]
    if missing:
        raise mismatch(
            f"declared {DOCX} but the archive has no {', '.join(missing)}: not a Word document"
        )


def _text_encoding(media_type: str, content: bytes) -> tuple[str, int]:
    """The codec the text is read in and how many leading bytes (a BOM) to skip: the
    indexer's rules exactly (a BOM first, HTML's ``<meta charset>``, else UTF-8). A declared
    ``charset`` parameter is not among them: the indexer never sees it (only the bare media
    type is stored), so text it cannot read must be refused here, not fail later."""
    if media_type == HTML:
        return html_encoding(content)
    return plain_encoding(content)


def _charset_hint(codec: str, charset: str | None) -> str:
    if not charset:
        return ""
    declared = text_codec(charset)
    if declared is not None and codecs.lookup(declared).name == codecs.lookup(codec).name:
        return ""
    return (
        f"; the declared charset {charset!r} is not used: send UTF-8 (or start with a "
        "byte-order mark)"
    )


def _check_text(media_type: str, content: bytes, charset: str | None) -> None:
    if _pdf_header_at(content):
        raise mismatch(f"declared {media_type} but the file is a PDF: declare {PDF}")
    if content.startswith(_ZIP_MAGIC):
        raise mismatch(f"declared {media_type} but the file is a zip archive, not text")
    codec, skip = _text_encoding(media_type, content)
    characters = controls = 0
    try:
        for text in decoded_pieces(content, codec, skip=skip):
            if "\x00" in text:
                raise mismatch(f"declared {media_type} but the file holds NUL bytes: not text")
            characters += len(text)
            controls += len(_BINARY_CONTROLS.findall(text))
    except UnicodeDecodeError as error:
        raise mismatch(
            f"declared {media_type} but the file is not valid {codec} text "
            f"({error.reason}){_charset_hint(codec, charset)}"
        ) from None
    if controls * 100 > characters * _MAX_CONTROLS_PER_100:
        raise mismatch(
            f"declared {media_type} but {controls} of its {characters} characters are "
            "control characters: binary data, not text"
        )


def check_content(media_type: str, content: bytes, *, charset: str | None = None) -> None:
    """Nothing when ``content`` can be what ``media_type`` (a supported, normalised type)
    says, else UnsupportedMediaType with code MEDIA_TYPE_MISMATCH, whatever is wrong with
    it. ``charset`` is the declared charset parameter of a text type."""
    if media_type == PDF:
        _check_pdf(content)
    elif media_type == DOCX:
        _check_docx(content)
    elif media_type in (TEXT, MARKDOWN, HTML):
        _check_text(media_type, content, charset)


async def run_media_check(check: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
    """``check`` (``check_content``, or a caller's check around it) in one of the media
    check's threads: the event loop serves every tenant meanwhile."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_checks, functools.partial(check, *args, **kwargs))
