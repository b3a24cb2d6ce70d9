"""PDF through pypdf: page text, sectioned by the document outline (bookmarks) if it has one.

An outline entry points at a page; its section runs from there to the next entry. Where
the entry's title can be found in its page's text the section starts exactly there (the
title line itself becomes the heading), otherwise at the start of what remains of the page.
Without an outline the pages are one section without headings. An encrypted PDF that does
not open with the empty password, or a file pypdf cannot read, fails; a PDF without any
extractable text (a scan) is empty.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass
from typing import Any

from pypdf import PdfReader
from pypdf.errors import LimitReachedError

from services.indexer.pipeline.section import Section, SectionBuilder, normalise_text
from services.indexer.task import ErrorCode, IndexingFailed


@dataclass(frozen=True)
class OutlineEntry:
    level: int  # 1 for a top-level bookmark
    title: str
    page: int  # 0-based


def outline_entries(reader: PdfReader) -> list[OutlineEntry]:
    """The outline flattened in reading order; entries without a page are skipped."""
    entries: list[OutlineEntry] = []
    # pypdf nests a child list right after its parent entry.
    stack: list[tuple[list[Any], int]] = [(list(reader.outline), 1)]
    while stack:
        items, level = stack.pop()
        for index, item in enumerate(items):
            if isinstance(item, list):
                stack.append((items[index + 1 :], level))
                stack.append((item, level + 1))
                break
            page = reader.get_destination_page_number(item)
            title = str(getattr(item, "title", "") or "")
            if page is not None and page >= 0 and title.strip():
                entries.append(OutlineEntry(level, title, page))
    return entries


def _title_pattern(title: str) -> re.Pattern[str]:
    words = [re.escape(word) for word in title.split()]
    return re.compile(r"\s+".join(words), re.IGNORECASE)


def _open(content: bytes) -> PdfReader:
    reader = PdfReader(io.BytesIO(content))
    if reader.is_encrypted:
        # Owner-only encryption (permissions) opens with the empty user password.
        try:
            opened = reader.decrypt("")
        except Exception as error:
            raise IndexingFailed(
                ErrorCode.DOCUMENT_PARSE_FAILED, f"encrypted PDF cannot be opened: {error}"
            ) from None
        if not opened:
            raise IndexingFailed(
                ErrorCode.DOCUMENT_PARSE_FAILED, "encrypted PDF: a password is required"
            )
    return reader


def parse_pdf(content: bytes) -> list[Section]:
    try:
        reader = _open(content)
        pages = [normalise_text(page.extract_text() or "") for page in reader.pages]
        entries = outline_entries(reader) if any(pages) else []
    except LimitReachedError as error:
        raise IndexingFailed(
            ErrorCode.DOCUMENT_TOO_LARGE, f"PDF exceeds a decompression limit: {error}"
        ) from None
    if not any(pages):
        raise IndexingFailed(ErrorCode.DOCUMENT_EMPTY, "PDF has no extractable text (scanned?)")
    builder = SectionBuilder()
    by_page: dict[int, list[OutlineEntry]] = {}
    for entry in sorted(entries, key=lambda e: e.page):  # stable: outline order within a page
        by_page.setdefault(entry.page, []).append(entry)
    for number, text in enumerate(pages):
        cursor = 0
        for entry in by_page.get(number, ()):
            found = _title_pattern(entry.title).search(text, cursor)
            start, end = (found.start(), found.end()) if found else (cursor, cursor)
            builder.block(text[cursor:start])
            builder.heading(entry.level, entry.title)
            cursor = end
        builder.block(text[cursor:])
    return builder.build()
