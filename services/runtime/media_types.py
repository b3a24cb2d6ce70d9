"""The media types kb-pipeline indexes, and how a declared type is normalised.

The publisher refuses anything else at upload (415); the indexer's parsers are chosen by the
same names, so what is accepted is exactly what can be parsed.
"""

from __future__ import annotations

from typing import Final

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
