from __future__ import annotations

from collections.abc import Callable

import pytest

from services.indexer.pipeline.parsing import parse_document
from services.indexer.task import ErrorCode, IndexingFailed
from services.runtime.indexing.media_types import PDF
from tests.support.documents import (
    SAMPLE,
    DocSection,
    heading_paths,
    make_corrupt_pdf,
    make_encrypted_pdf,
    make_large_pdf,
    make_pdf,
    make_scanned_pdf,
    make_truncated_pdf,
)


def pdf_sections(sample: tuple[DocSection, ...]) -> list[tuple[tuple[str, ...], str]]:
    # A PDF has lines, not paragraphs: a section's paragraphs come back one per line.
    return [
        (path, "\n".join(section.paragraphs))
        for path, section in zip(heading_paths(sample), sample, strict=True)
    ]


def parsed(content: bytes) -> list[tuple[tuple[str, ...], str]]:
    return [(section.heading_path, section.text) for section in parse_document(PDF, content)]


@pytest.mark.parametrize("page_per_section", [True, False])
def test_outline_entries_become_heading_paths(page_per_section: bool) -> None:
    content = make_pdf(SAMPLE, page_per_section=page_per_section)
    assert parsed(content) == pdf_sections(SAMPLE)


def test_exact_paths_from_the_outline() -> None:
    assert [path for path, _ in parsed(make_pdf())] == [
        ("Refund policy",),
        ("Refund policy", "Window"),
        ("Refund policy", "Window", "Late requests"),
        ("Refund policy", "Exceptions"),
        ("Shipping",),
        ("Shipping", "Customs"),
    ]


def test_without_an_outline_the_pages_are_one_section_without_headings() -> None:
    sections = parse_document(PDF, make_pdf(SAMPLE[:2], outline=False))
    assert [section.heading_path for section in sections] == [()]
    assert sections[0].text.startswith("Refund policy\nRefunds are available")
    assert sections[0].text.endswith("it proves the date of purchase.")


def test_a_section_runs_across_pages_until_the_next_entry() -> None:
    sections = parse_document(PDF, make_large_pdf(pages=3, lines_per_page=60))
    # 60 lines overflow each page; the overflow stays in its part.
    assert [section.heading_path for section in sections] == [
        ("Part 0",),
        ("Part 1",),
        ("Part 2",),
    ]
    assert all(section.text.count("line ") == 60 for section in sections)


def test_a_pdf_encrypted_only_against_editing_opens_with_the_empty_password() -> None:
    assert parsed(make_encrypted_pdf(user_password="")) == [((), "Confidential text.")]


@pytest.mark.parametrize(
    ("make", "code"),
    [
        (make_encrypted_pdf, ErrorCode.DOCUMENT_PARSE_FAILED),
        (make_corrupt_pdf, ErrorCode.DOCUMENT_PARSE_FAILED),
        (make_truncated_pdf, ErrorCode.DOCUMENT_PARSE_FAILED),
        (lambda: b"not a pdf at all", ErrorCode.DOCUMENT_PARSE_FAILED),
        (lambda: b"", ErrorCode.DOCUMENT_PARSE_FAILED),
        (make_scanned_pdf, ErrorCode.DOCUMENT_EMPTY),
    ],
)
def test_bad_pdfs_fail_with_their_code(make: Callable[[], bytes], code: str) -> None:
    with pytest.raises(IndexingFailed) as failed:
        parse_document(PDF, make())
    assert failed.value.code == code
