from __future__ import annotations

import io
import zipfile

import pytest
from docx import Document
from docx.enum.style import WD_STYLE_TYPE

from services.indexer.pipeline.parsing import ParseLimits, parse_document
from services.indexer.pipeline.parsing import docx as docx_parser
from services.indexer.task import ErrorCode, IndexingFailed
from services.runtime.indexing.media_types import DOCX
from tests.support.documents import (
    SAMPLE,
    expected_sections,
    make_docx,
    make_docx_swelling,
    make_docx_zip_bomb,
    make_text,
    make_zip_not_docx,
)


def parsed(content: bytes) -> list[tuple[tuple[str, ...], str]]:
    return [(section.heading_path, section.text) for section in parse_document(DOCX, content)]


def test_heading_styles_build_the_heading_path() -> None:
    assert parsed(make_docx(SAMPLE)) == expected_sections(SAMPLE)


def test_title_heads_the_whole_document() -> None:
    paths = [path for path, _ in parsed(make_docx(SAMPLE[:3], title="Handbook"))]
    assert paths == [
        ("Handbook", "Refund policy"),
        ("Handbook", "Refund policy", "Window"),
        ("Handbook", "Refund policy", "Window", "Late requests"),
    ]


def test_tables_stay_in_document_order_as_rows() -> None:
    sections = parsed(make_docx(SAMPLE[:2], table_after=1))
    assert sections == [
        (("Refund policy",), SAMPLE[0].paragraphs[0]),
        (
            ("Refund policy", "Window"),
            "\n\n".join(SAMPLE[1].paragraphs) + "\n\nPlan | Days\nBasic | 14\nPlus | 30",
        ),
    ]


def test_a_zip_bomb_is_refused_by_its_ratio_before_python_docx_opens_it() -> None:
    with pytest.raises(IndexingFailed) as failed:
        parse_document(DOCX, make_docx_zip_bomb(16 * 1024 * 1024))
    assert failed.value.code == ErrorCode.DOCUMENT_TOO_LARGE
    assert "ratio" in failed.value.message


def test_a_zip_bomb_is_refused_by_its_total_size() -> None:
    limits = ParseLimits(max_decompressed_bytes=1024 * 1024, max_compression_ratio=1e9)
    with pytest.raises(IndexingFailed) as failed:
        parse_document(DOCX, make_docx_zip_bomb(2 * 1024 * 1024), limits)
    assert failed.value.code == ErrorCode.DOCUMENT_TOO_LARGE
    assert "decompress" in failed.value.message


def test_one_member_too_large_is_refused_before_anything_is_decompressed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_decompression(*args: object, **kwargs: object) -> None:
        raise AssertionError("a member was opened")

    bomb = make_docx_zip_bomb(2 * 1024 * 1024)
    monkeypatch.setattr(zipfile.ZipFile, "open", no_decompression)
    monkeypatch.setattr(docx_parser, "Document", no_decompression)
    limits = ParseLimits(max_member_bytes=1024 * 1024, max_compression_ratio=1e9)
    with pytest.raises(IndexingFailed) as failed:
        parse_document(DOCX, bomb, limits)
    assert failed.value.code == ErrorCode.DOCUMENT_TOO_LARGE
    assert "word/media/padding.bin" in failed.value.message
    assert "per member" in failed.value.message


def test_the_review_docx_passes_the_totals_but_not_the_member_cap() -> None:
    # The review's DOCX: total size and ratio under their limits, one swelling XML part.
    swelling = make_docx_swelling()
    docx_parser.check_archive(swelling, ParseLimits(max_member_bytes=64 * 1024 * 1024))
    with pytest.raises(IndexingFailed) as failed:
        docx_parser.check_archive(swelling, ParseLimits(max_member_bytes=32 * 1024 * 1024))
    assert failed.value.code == ErrorCode.DOCUMENT_TOO_LARGE
    assert "word/document.xml" in failed.value.message


def test_an_ordinary_docx_passes_the_default_guard() -> None:
    assert parsed(make_docx(SAMPLE[:1])) == expected_sections(SAMPLE[:1])


@pytest.mark.parametrize(
    "content",
    [make_text(["plain text"]), make_zip_not_docx(), b"PK\x03\x04 truncated", b""],
)
def test_not_a_docx_fails_to_parse(content: bytes) -> None:
    with pytest.raises(IndexingFailed) as failed:
        parse_document(DOCX, content)
    assert failed.value.code == ErrorCode.DOCUMENT_PARSE_FAILED


def test_a_docx_without_text_is_empty() -> None:
    with pytest.raises(IndexingFailed) as failed:
        parse_document(DOCX, make_docx(()))
    assert failed.value.code == ErrorCode.DOCUMENT_EMPTY


def test_a_custom_style_based_on_a_heading_is_that_heading() -> None:
    document = Document()
    custom = document.styles.add_style("Policy Heading", WD_STYLE_TYPE.PARAGRAPH)
    custom.base_style = document.styles["Heading 2"]
    document.add_heading("Policies", level=1)
    document.add_paragraph("Refund", style="Policy Heading")
    document.add_paragraph("Within 30 days.")
    out = io.BytesIO()
    document.save(out)
    assert parsed(out.getvalue()) == [(("Policies", "Refund"), "Within 30 days.")]
