from __future__ import annotations

import codecs

import pytest

from services.indexer.pipeline.parsing import Section, parse_document
from services.indexer.task import ErrorCode, IndexingFailed
from services.runtime.indexing.media_types import TEXT
from tests.support.documents import make_text

PARAGRAPHS = ("Größe  und\tGewicht", "Zweiter   Absatz\nmit Zeilenumbruch.")
EXPECTED = [Section((), "Größe und Gewicht\n\nZweiter Absatz\nmit Zeilenumbruch.")]


@pytest.mark.parametrize(
    ("encoding", "bom"),
    [
        ("utf-8", False),
        ("utf-8", True),
        ("utf-16-le", True),
        ("utf-16-be", True),
        ("utf-32", False),
    ],
)
def test_text_is_decoded_by_bom_or_as_utf8(encoding: str, bom: bool) -> None:
    # Python's "utf-32" codec writes its own BOM.
    assert parse_document(TEXT, make_text(PARAGRAPHS, encoding=encoding, bom=bom)) == EXPECTED


def test_utf16_without_its_bom_is_not_guessed() -> None:
    with pytest.raises(IndexingFailed) as failed:
        parse_document(TEXT, "Größe".encode("utf-16-le"))
    assert failed.value.code == ErrorCode.DOCUMENT_PARSE_FAILED


@pytest.mark.parametrize(
    "content",
    [
        "café".encode("latin-1"),
        b"ok \xc3\x28 broken",
        codecs.BOM_UTF8 + b"\xff\xfe",
        codecs.BOM_UTF16_LE + b"\x00\xd8",  # a lone surrogate
    ],
)
def test_undecodable_bytes_fail_clearly_instead_of_mojibake(content: bytes) -> None:
    with pytest.raises(IndexingFailed) as failed:
        parse_document(TEXT, content)
    assert failed.value.code == ErrorCode.DOCUMENT_PARSE_FAILED
    assert "not valid" in failed.value.message


def test_whitespace_is_normalised_and_control_characters_dropped() -> None:
    content = b"  first\x00line  \r\n\r\n\r\n\r\n second\x07 \n"
    assert parse_document(TEXT, content) == [Section((), "first line\n\nsecond")]


@pytest.mark.parametrize("content", [b"", b"   \n\n\t ", codecs.BOM_UTF8])
def test_text_without_words_is_empty(content: bytes) -> None:
    with pytest.raises(IndexingFailed) as failed:
        parse_document(TEXT, content)
    assert failed.value.code == ErrorCode.DOCUMENT_EMPTY


def test_invisible_characters_do_not_split_words() -> None:
    content = "re\u00adfund win\u200bdow\ufeff\u00a0policy".encode()
    assert parse_document(TEXT, content) == [Section((), "refund window policy")]


@pytest.mark.parametrize("seed", range(20))
def test_a_long_text_normalised_in_blocks_is_the_whole_text_normalised(seed: int) -> None:
    import random

    from services.indexer.pipeline.parsing.text import _blocks
    from services.indexer.pipeline.section import normalise_text

    rng = random.Random(seed)
    pieces = ["word", " ", "\n", "\n\n", "\r\n", "\r", "\t", "  \n \n", "\x0b", "\u200b", "é"]
    text = "".join(rng.choice(pieces) for _ in range(3000))
    blocks = [normalise_text(block) for block in _blocks(text, size=rng.randint(5, 200))]
    assert len(blocks) > 1 or "\n\n" not in text[200:]
    assert "\n\n".join(block for block in blocks if block) == normalise_text(text)


@pytest.mark.parametrize("seed", range(5))
def test_each_line_has_its_runs_of_any_unicode_space_made_one_and_its_ends_stripped(
    seed: int,
) -> None:
    import random
    import re

    from services.indexer.pipeline.section import normalise_text

    def by_the_rule(text: str) -> str:
        text = re.sub(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]", " ", re.sub("\r\n?", "\n", text))
        text = re.sub("[\u00ad\u200b-\u200d\u2060\ufeff]", "", text)
        lines = [re.sub(r"[^\S\n]+", " ", line).strip() for line in text.split("\n")]
        return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()

    rng = random.Random(seed)
    spaces = [chr(c) for c in range(0x3001) if chr(c).isspace()]
    pieces = ["a", "b.", "\n", "\r\n", "\x00", "\x7f", "\u200b", "\u00ad", *spaces]
    for _ in range(2000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 24)))
        assert normalise_text(text) == by_the_rule(text), repr(text)
