"""Parsing: a document version's bytes, by media type, into sections under heading paths.

``parse_document`` is the boundary: whatever a parsing library raises leaves it as an
``IndexingFailed`` with one of the document codes, never as the library's own exception.
"""

from __future__ import annotations

from collections.abc import Callable

from services.indexer.pipeline.parsing.limits import ParseLimits, near_memory_limit
from services.indexer.pipeline.section import Section
from services.indexer.task import ErrorCode, IndexingFailed
from services.runtime.indexing import media_types

__all__ = ["ParseLimits", "Section", "parse_document"]

_MESSAGE_LIMIT = 200
_DEFAULT_LIMITS = ParseLimits()


_Parser = Callable[[bytes, ParseLimits], list[Section]]


# Each parser's module (and its library: pypdf, python-docx, selectolax, markdown-it) is
# imported at its first document: the parse processes preload them all, and the indexer
# itself only ever parses small text and Markdown (parsing.pool), so it starts without them.
def _text(content: bytes, limits: ParseLimits) -> list[Section]:
    from services.indexer.pipeline.parsing.text import parse_text

    return parse_text(content)


def _markdown(content: bytes, limits: ParseLimits) -> list[Section]:
    from services.indexer.pipeline.parsing.markdown import parse_markdown

    return parse_markdown(content)


def _html(content: bytes, limits: ParseLimits) -> list[Section]:
    from services.indexer.pipeline.parsing.html import parse_html

    return parse_html(content)


def _pdf(content: bytes, limits: ParseLimits) -> list[Section]:
    from services.indexer.pipeline.parsing.pdf import parse_pdf

    return parse_pdf(content)


def _docx(content: bytes, limits: ParseLimits) -> list[Section]:
    from services.indexer.pipeline.parsing.docx import parse_docx

    return parse_docx(content, limits)


_PARSERS: dict[str, _Parser] = {
    media_types.TEXT: _text,
    media_types.MARKDOWN: _markdown,
    media_types.HTML: _html,
    media_types.PDF: _pdf,
    media_types.DOCX: _docx,
}


def _short(error: BaseException) -> str:
    text = " ".join(str(error).split()) or "no detail"
    text = f"{type(error).__name__}: {text}"
    return text if len(text) <= _MESSAGE_LIMIT else text[: _MESSAGE_LIMIT - 1] + "…"


def _out_of_memory(media_type: str, limit: int | None) -> IndexingFailed:
    return IndexingFailed(
        ErrorCode.DOCUMENT_TOO_LARGE,
        f"{media_type} needs more memory than a parse process may use "
        f"(KB_INDEXER_PARSE_MEMORY_LIMIT_BYTES = {limit})"
        if limit is not None
        else f"{media_type} needs more memory than there is",
    )


def parse_document(
    media_type: str, content: bytes, limits: ParseLimits = _DEFAULT_LIMITS
) -> list[Section]:
    """Non-empty sections in document order. Raises ``IndexingFailed`` with
    UNSUPPORTED_DOCUMENT, DOCUMENT_PARSE_FAILED, DOCUMENT_EMPTY or DOCUMENT_TOO_LARGE."""
    normalised = media_types.normalise_media_type(media_type)
    parser = _PARSERS.get(normalised)
    if parser is None:
        raise IndexingFailed(
            ErrorCode.UNSUPPORTED_DOCUMENT, f"no parser for media type {media_type!r}"
        )
    try:
        sections = parser(content, limits)
    except IndexingFailed:
        raise
    except MemoryError:
        # Past the parse process's address-space limit (ParseLimits.memory_limit_bytes).
        raise _out_of_memory(normalised, near_memory_limit()) from None
    except Exception as error:
        limit = near_memory_limit()
        if limit is not None:
            # A library's own error for a failed allocation (lxml: XMLSyntaxError).
            raise _out_of_memory(normalised, limit) from None
        # Libraries raise anything from their own errors to KeyError on a malformed file.
        raise IndexingFailed(
            ErrorCode.DOCUMENT_PARSE_FAILED, f"{normalised} could not be parsed: {_short(error)}"
        ) from None
    if not sections:
        raise IndexingFailed(ErrorCode.DOCUMENT_EMPTY, f"the {normalised} document has no text")
    return sections
