"""Whatever the bytes, parsing ends in sections or in one of the document codes."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.indexer.pipeline.parsing import parse_document
from services.indexer.task import ErrorCode, IndexingFailed
from services.runtime.indexing import media_types
from tests.support.documents import make_docx, make_html, make_markdown, make_pdf

DOCUMENT_CODES = {
    ErrorCode.DOCUMENT_PARSE_FAILED,
    ErrorCode.DOCUMENT_EMPTY,
    ErrorCode.DOCUMENT_TOO_LARGE,
}
VALID = {
    media_types.TEXT: b"Plain words.\n\nMore words.",
    media_types.MARKDOWN: make_markdown(),
    media_types.HTML: make_html(),
    media_types.PDF: make_pdf(),
    media_types.DOCX: make_docx(),
}


def check(media_type: str, content: bytes) -> None:
    code = None
    try:
        sections = parse_document(media_type, content)
    except IndexingFailed as failed:
        code = failed.code
        sections = []
    if code is not None:
        assert code in DOCUMENT_CODES
        return
    assert sections
    for section in sections:
        assert section.text
        assert section.text == section.text.strip()
        assert all(title and title == " ".join(title.split()) for title in section.heading_path)


@pytest.mark.parametrize("media_type", sorted(VALID))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_damaged_documents_fail_with_a_document_code(media_type: str, data: st.DataObject) -> None:
    content = bytearray(VALID[media_type])
    for _ in range(data.draw(st.integers(min_value=1, max_value=8), label="damages")):
        position = data.draw(st.integers(min_value=0, max_value=len(content) - 1))
        content[position] = data.draw(st.integers(min_value=0, max_value=255))
    cut = data.draw(st.integers(min_value=0, max_value=len(content)), label="length")
    check(media_type, bytes(content[:cut]))


@pytest.mark.parametrize("media_type", sorted(VALID))
@settings(max_examples=25, deadline=None)
@given(content=st.binary(max_size=2000))
def test_random_bytes_fail_with_a_document_code(media_type: str, content: bytes) -> None:
    check(media_type, content)
