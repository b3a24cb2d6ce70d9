from __future__ import annotations

import pytest

from services.indexer.pipeline.parsing import parse_document
from services.indexer.task import ErrorCode, IndexingFailed
from services.runtime.indexing import media_types
from tests.support.documents import make_markdown


@pytest.mark.parametrize("media_type", ["image/png", "application/msword", "", "text/csv"])
def test_unknown_media_types_are_unsupported(media_type: str) -> None:
    with pytest.raises(IndexingFailed) as failed:
        parse_document(media_type, b"anything")
    assert failed.value.code == ErrorCode.UNSUPPORTED_DOCUMENT


def test_media_type_parameters_and_aliases_are_normalised() -> None:
    for declared in ("text/markdown; charset=utf-8", "TEXT/X-MARKDOWN"):
        sections = parse_document(declared, make_markdown())
        assert sections[0].heading_path == ("Refund policy",)


def test_every_supported_media_type_has_a_parser() -> None:
    for media_type in media_types.SUPPORTED_MEDIA_TYPES:
        with pytest.raises(IndexingFailed) as failed:
            parse_document(media_type, b"")
        assert failed.value.code != ErrorCode.UNSUPPORTED_DOCUMENT


def test_a_library_exception_leaves_as_a_parse_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    import services.indexer.pipeline.parsing as parsing

    def explode(content: bytes) -> list[parsing.Section]:
        raise KeyError("/Root" + "x" * 500)

    monkeypatch.setitem(parsing._PARSERS, media_types.TEXT, lambda content, _: explode(content))
    with pytest.raises(IndexingFailed) as failed:
        parse_document(media_types.TEXT, b"text")
    assert failed.value.code == ErrorCode.DOCUMENT_PARSE_FAILED
    assert failed.value.message.startswith("text/plain could not be parsed: KeyError:")
    assert len(failed.value.message) < 260
