"""Plain text: decoded by its byte-order mark or as strict UTF-8, split into paragraphs.

Bytes that are not valid in the detected encoding fail the document: text that cannot be
read exactly is never indexed as mojibake.
"""

from __future__ import annotations

from collections.abc import Iterator

from services.indexer.pipeline.section import Section, SectionBuilder
from services.indexer.task import ErrorCode, IndexingFailed
from services.runtime.errors import UnsupportedMediaType

# The byte-order marks and encodings are the publisher's too: what it accepts as text is what
# is read here, and nothing is decoded with a codec outside its allow-list.
from services.runtime.indexing.text_encodings import bom_encoding, decode_all


def decode(content: bytes, encoding: str, *, skip: int = 0) -> str:
    try:
        return decode_all(content, encoding, skip=skip)
    except UnsupportedMediaType as refused:
        raise IndexingFailed(ErrorCode.DOCUMENT_PARSE_FAILED, refused.message) from None
    except UnicodeDecodeError as error:
        raise IndexingFailed(
            ErrorCode.DOCUMENT_PARSE_FAILED,
            f"not valid {encoding} text at byte {error.start + skip} ({error.reason})",
        ) from None


def decode_text(content: bytes) -> str:
    """UTF-8 (with or without BOM), UTF-16 or UTF-32 by BOM; nothing is guessed."""
    found = bom_encoding(content)
    if found is not None:
        return decode(content, found[0], skip=found[1])
    return decode(content, "utf-8")


# A long text is normalised in blocks of about this many characters, cut at blank lines:
# normalising 50 MB at once held several copies of it (lines, stripped lines, joins).
_BLOCK_CHARS = 1 << 20


def _blocks(text: str, size: int = _BLOCK_CHARS) -> Iterator[str]:
    """``text`` in pieces cut just before a blank line (``\n\n``), each about ``size``
    characters or, where no blank line comes soon enough, longer. Normalising the pieces
    and joining them with a blank line is normalising the whole: each cut falls inside a
    run of line breaks, which normalisation turns into exactly one blank line."""
    start = 0
    while len(text) - start > size:
        cut = text.find("\n\n", start + size)
        if cut < 0:
            break
        yield text[start:cut]
        start = cut
    yield text[start:]


def parse_text(content: bytes) -> list[Section]:
    # One section without headings; normalising keeps the blank lines between paragraphs.
    builder = SectionBuilder()
    for block in _blocks(decode_text(content)):
        builder.block(block)
    return builder.build()
