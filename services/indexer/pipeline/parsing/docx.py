"""DOCX through python-docx, after a zip-bomb check on the archive's declared sizes.

``Title`` and ``Heading N`` paragraph styles (or styles based on them) are headings;
tables stay where they are in the body, one ``cell | cell`` line per row. The archive is
checked before python-docx opens it: too much declared uncompressed data (in all, or in one
member), or a compression ratio no real document has, is DOCUMENT_TOO_LARGE. (Reading a zip
member stops at its declared size, so the declared sizes bound what is decompressed.)
"""

from __future__ import annotations

import io
import re
import zipfile
from typing import TYPE_CHECKING, Any

from docx import Document
from docx.enum.style import WD_STYLE_TYPE
from docx.table import Table

from services.indexer.pipeline.section import Section, SectionBuilder
from services.indexer.task import ErrorCode, IndexingFailed

if TYPE_CHECKING:
    from services.indexer.pipeline.parsing.limits import ParseLimits

_HEADING_STYLE = re.compile(r"heading\s*([1-9])", re.IGNORECASE)
_REQUIRED_PARTS = ("[Content_Types].xml", "word/document.xml")


def check_archive(content: bytes, limits: ParseLimits) -> None:
    try:
        with zipfile.ZipFile(io.BytesIO(content)) as archive:
            members = archive.infolist()
            names = {member.filename for member in members}
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, EOFError) as error:
        raise IndexingFailed(
            ErrorCode.DOCUMENT_PARSE_FAILED, f"not a DOCX (not a zip archive): {error}"
        ) from None
    missing = [part for part in _REQUIRED_PARTS if part not in names]
    if missing:
        raise IndexingFailed(
            ErrorCode.DOCUMENT_PARSE_FAILED, f"not a DOCX: the archive lacks {', '.join(missing)}"
        )
    largest = max(members, key=lambda member: member.file_size)
    if largest.file_size > limits.max_member_bytes:
        raise IndexingFailed(
            ErrorCode.DOCUMENT_TOO_LARGE,
            f"DOCX member {largest.filename!r} would decompress to {largest.file_size} bytes "
            f"(limit {limits.max_member_bytes} per member)",
        )
    uncompressed = sum(member.file_size for member in members)
    compressed = sum(member.compress_size for member in members)
    if uncompressed > limits.max_decompressed_bytes:
        raise IndexingFailed(
            ErrorCode.DOCUMENT_TOO_LARGE,
            f"DOCX would decompress to {uncompressed} bytes "
            f"(limit {limits.max_decompressed_bytes})",
        )
    ratio = uncompressed / max(1, compressed)
    if ratio > limits.max_compression_ratio:
        raise IndexingFailed(
            ErrorCode.DOCUMENT_TOO_LARGE,
            f"DOCX compression ratio {ratio:.0f} exceeds {limits.max_compression_ratio:.0f}",
        )


def _style_level(style: Any) -> int | None:
    """0 for Title, N for Heading N, following a custom style to the built-in it is based on."""
    for _ in range(8):  # a base-style chain is short; a cycle must not loop forever
        if style is None:
            return None
        name = (style.name or "").strip()
        if name.lower() == "title":
            return 0
        matched = _HEADING_STYLE.fullmatch(name)
        if matched:
            return int(matched.group(1))
        style = style.base_style
    return None


def heading_levels(document: Any) -> dict[str | None, int | None]:
    """Heading level by paragraph style id (``None``: the default style), read once:
    python-docx resolves ``Paragraph.style`` by scanning every style, per paragraph."""
    levels: dict[str | None, int | None] = {
        style.style_id: _style_level(style)
        for style in document.styles
        if style.type == WD_STYLE_TYPE.PARAGRAPH
    }
    levels[None] = _style_level(document.styles.default(WD_STYLE_TYPE.PARAGRAPH))
    return levels


def _row_text(row: Any) -> str:
    cells: list[str] = []
    seen: set[int] = set()
    for cell in row.cells:
        # A merged cell is reported once per grid column it spans.
        if id(cell._tc) in seen:
            continue
        seen.add(id(cell._tc))
        cells.append(" ".join(cell.text.split()))
    return " | ".join(cells) if any(cells) else ""


def parse_docx(content: bytes, limits: ParseLimits) -> list[Section]:
    check_archive(content, limits)
    document = Document(io.BytesIO(content))
    levels = heading_levels(document)
    builder = SectionBuilder()
    for item in document.iter_inner_content():
        if isinstance(item, Table):
            builder.block("\n".join(_row_text(row) for row in item.rows))
            continue
        style_id = item._p.style
        # An unknown style id falls back to the default style, as in Word.
        level = levels.get(style_id, levels[None])
        if level is None:
            builder.block(item.text)
        else:
            builder.heading(level, item.text)
    return builder.build()
