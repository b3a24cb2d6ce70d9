"""Chunking: sections into token-bounded, heading-aware chunks with deterministic ids.

What is embedded is the heading path followed by the chunk text, and that whole input
stays within the strategy's ``max_tokens`` as the embedding model's tokenizer counts it; a
chunk never spans two heading paths. A section that fits is one chunk, counted once and
not split. A larger one is split on its own by semchunk, which prefers paragraph, then
line, then sentence, then word boundaries; a section over ``WINDOW_CHARS`` is first cut at
paragraph breaks into windows of about that size, chunked one after another, so that
chunks can be handed on while a huge section is still being chunked. Adjacent small
sections under the same heading path are packed into one chunk while its input fits
(docs/architecture.md#the-indexer). The same sections and strategy always give the same
chunks with the same ids, so re-running a task writes the same rows.
"""

from __future__ import annotations

import hashlib
import uuid
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Final

from semchunk.semchunk import chunk as semchunk_chunk

from services.embedding.tokens import TokenCounter, TokenizerSpec
from services.index.generation import CODE_MARK
from services.indexer.chunk import Chunk, chunk_id_of, embedding_input_of
from services.indexer.pipeline.chunking_code import ChunkingCode, chunking_code, code_digest
from services.indexer.pipeline.section import Section
from services.runtime.errors import ConfigError

# Between the sections of a pack, as between the blocks of one section (section.py).
SECTION_SEPARATOR: Final = "\n\n"
# The heading prefix may take at most this share of a chunk; deeper paths lose their
# outermost headings first (the innermost says most about the text).
_MAX_HEADING_SHARE: Final = 0.5
# Few texts take more characters per token: a longer candidate is judged by a prefix of
# this many characters per token of budget, and only a shorter section is tried whole.
_CHARS_PER_TOKEN: Final = 6
_TOKEN_CHARS_SLACK: Final = 64
# Sections longer than this many characters are chunked window by window (``_windows``).
WINDOW_CHARS: Final = 1 << 20


@dataclass(frozen=True)
class ChunkingStrategy:
    tokenizer: TokenizerSpec
    max_tokens: int = 256  # per chunk, heading prefix included
    overlap_tokens: int = 0
    name: str = "heading-semchunk-v1"
    # The versions of the code that chunks (chunking_code.py): taken from the installed code
    # when not given, once, so that a strategy sent to a parse process keeps the parent's.
    code: ChunkingCode = ()

    def __post_init__(self) -> None:
        if not 8 <= self.max_tokens <= self.tokenizer.max_counted_tokens:
            raise ConfigError(
                f"chunk max_tokens {self.max_tokens} must be between 8 and the model's "
                f"{self.tokenizer.max_counted_tokens} input tokens (special tokens excluded)"
            )
        if not 0 <= self.overlap_tokens < self.max_tokens // 2:
            raise ConfigError(
                f"chunk overlap_tokens {self.overlap_tokens} must be below half of max_tokens"
            )
        if not self.code:
            object.__setattr__(self, "code", chunking_code(self.tokenizer))

    @property
    def strategy_id(self) -> str:
        """Names everything that changes the chunks: a different id is a different index.
        The settings are spelled out; the code that chunks is a digest of its versions."""
        return (
            f"{self.name}:max={self.max_tokens}:overlap={self.overlap_tokens}"
            f":tok={self.tokenizer.name}{CODE_MARK}{code_digest(self.code)}"
        )


class _Memo:
    """semchunk counts the same candidate texts over and over; one document's counts are
    kept for the document only (semchunk's own memo would grow for the process's life)."""

    def __init__(self, count: TokenCounter) -> None:
        self._count = count
        self._known: dict[str, int] = {}

    def forget_all_but(self, keep: str) -> None:
        """Lets go of every count but ``keep``'s (the next window of a huge section)."""
        kept = self._known.get(keep)
        self._known.clear()
        if kept is not None:
            self._known[keep] = kept

    def __call__(self, text: str) -> int:
        known = self._known.get(text)
        if known is None:
            known = self._known[text] = self._count(text)
        return known


def _fit_heading_path(
    path: tuple[str, ...], max_tokens: int, count: TokenCounter
) -> tuple[str, ...]:
    allowed = int(max_tokens * _MAX_HEADING_SHARE)
    while path and count(embedding_input_of(path, "")) > allowed:
        if len(path) > 1:
            path = path[1:]
            continue
        title = path[0]
        low, high = 0, len(title)  # the longest prefix of the title that fits
        while low < high:
            middle = (low + high + 1) // 2
            if count(embedding_input_of((title[:middle],), "")) <= allowed:
                low = middle
            else:
                high = middle - 1
        path = (title[:low].rstrip(),) if title[:low].strip() else ()
    return path


def _fits_count(candidate: str, size: int, count: TokenCounter) -> int:
    """``count(candidate)``, or ``size + 1`` when a prefix of a long candidate is already
    over ``size``: "does this fit?" is answered without tokenizing megabytes (no token is
    longer than the window's slack; every piece's final input is counted exactly)."""
    window = size * _CHARS_PER_TOKEN + _TOKEN_CHARS_SLACK
    if len(candidate) > window and count(candidate[:window]) > size:
        return size + 1
    return count(candidate)


def _split(text: str, size: int, overlap: int, count: TokenCounter) -> list[str]:
    pieces = semchunk_chunk(
        text,
        chunk_size=size,
        token_counter=lambda candidate: _fits_count(candidate, size, count),
        memoize=False,
        overlap=overlap or None,
    )
    assert isinstance(pieces, list)  # without offsets=True semchunk returns just the texts
    return [piece for piece in pieces if piece.strip()]


def _prefix_tokens(path: tuple[str, ...], count: TokenCounter) -> int:
    return count(embedding_input_of(path, "")) if path else 0


def _fits_whole(
    text: str, path: tuple[str, ...], strategy: ChunkingStrategy, count: TokenCounter
) -> bool:
    """Whether splitting would keep ``text`` whole, asked without splitting: semchunk
    returns a text within its size as it is, and the full input must fit too. Counts the
    text once (under a heading, its input once more), where semchunk would count its first
    paragraph, then runs of paragraphs, then the whole. A text longer than most that fit
    is not counted whole: it goes to semchunk, which keeps it whole if it fits after all."""
    budget = strategy.max_tokens - _prefix_tokens(path, count)
    return (
        len(text) <= budget * _CHARS_PER_TOKEN
        and count(text) <= budget
        and count(embedding_input_of(path, text)) <= strategy.max_tokens
    )


def _section_pieces(
    text: str, path: tuple[str, ...], strategy: ChunkingStrategy, count: TokenCounter
) -> list[str]:
    # With an overlap semchunk cuts even a text that fits into overlapping pieces: only
    # without one is a text that fits its own one piece.
    if not strategy.overlap_tokens and _fits_whole(text, path, strategy, count):
        return [text]
    budget = strategy.max_tokens - _prefix_tokens(path, count)
    pieces: list[str] = []
    pending = deque(_split(text, budget, strategy.overlap_tokens, count))
    # Token counts are not always additive (the joint text may tokenize differently), so
    # every full input is checked; one that is over is split again, more tightly.
    while pending:
        piece = pending.popleft()
        excess = count(embedding_input_of(path, piece)) - strategy.max_tokens
        if excess <= 0 or count(piece) <= 1:
            pieces.append(piece)
            continue
        tighter = max(1, min(budget, count(piece)) - excess)
        smaller = _split(piece, tighter, 0, count)
        if smaller == [piece]:  # nothing left to split (one character over budget)
            pieces.append(piece)
            continue
        pending.extendleft(reversed(smaller))
    return pieces


def _windows(text: str, size: int) -> Iterator[str]:
    """A huge section in pieces of about ``size`` characters, cut at a paragraph break
    (else a line break, else anywhere): semchunk then holds one window's candidates at a
    time, not a 50 MB section's. Sections under ``size`` are one window, as before."""
    start = 0
    while len(text) - start > size:
        end = start + size
        cut = text.rfind("\n\n", start + size // 2, end)
        if cut < 0:
            cut = text.rfind("\n", start + size // 2, end)
        if cut < 0:
            cut = end
        yield text[start:cut]
        start = cut
    yield text[start:]


class _Pack:
    """Adjacent small sections under one heading path, gathered into one chunk while its
    full input stays within ``max_tokens``."""

    def __init__(self, heading_path: tuple[str, ...], path: tuple[str, ...], text: str) -> None:
        self.heading_path = heading_path  # the sections' own, before it was fitted
        self.path = path
        self.text = text

    def take(
        self,
        heading_path: tuple[str, ...],
        text: str,
        strategy: ChunkingStrategy,
        count: TokenCounter,
    ) -> bool:
        """Adds the next section if it is under the same heading path and the pack still
        fits with it (then the section alone would fit too: a small one)."""
        if heading_path != self.heading_path:
            return False
        packed = self.text + SECTION_SEPARATOR + text
        budget = strategy.max_tokens - _prefix_tokens(self.path, count)
        if len(packed) > budget * _CHARS_PER_TOKEN:
            return False
        if count(embedding_input_of(self.path, packed)) > strategy.max_tokens:
            return False
        self.text = packed
        return True


def _huge_section_pieces(
    text: str, path: tuple[str, ...], strategy: ChunkingStrategy, count: _Memo
) -> Iterator[str]:
    for window_number, window in enumerate(_windows(text, WINDOW_CHARS)):
        if window_number:
            count.forget_all_but(embedding_input_of(path, ""))
        yield from _section_pieces(window, path, strategy, count)


def _chunk_texts(
    sections: Iterable[Section], strategy: ChunkingStrategy, count_tokens: TokenCounter
) -> Iterator[tuple[tuple[str, ...], str]]:
    """(heading path as fitted, text) of each chunk of a document, in order."""
    heading_path: tuple[str, ...] | None = None
    path: tuple[str, ...] = ()
    count = _Memo(count_tokens)
    pack: _Pack | None = None
    for section in sections:
        # Counts are remembered for one section (one window of a huge one), and the heading
        # prefix's while the path stays: a huge document's candidate texts are not kept
        # for its whole life.
        if section.heading_path != heading_path:
            heading_path = section.heading_path
            count = _Memo(count_tokens)
            path = _fit_heading_path(heading_path, strategy.max_tokens, count)
        else:
            count.forget_all_but(embedding_input_of(path, ""))
        huge = len(section.text) > WINDOW_CHARS
        pieces: list[str] | None = None
        if strategy.overlap_tokens and not huge:
            # With an overlap semchunk may cut even a section that fits; one it cuts is no
            # small section and joins no pack. Without one, a section that fits in the
            # pack is small: its pieces are not needed.
            pieces = _section_pieces(section.text, path, strategy, count)
        if pack is not None:
            if pieces in (None, [section.text]) and pack.take(
                heading_path, section.text, strategy, count
            ):
                continue
            yield pack.path, pack.text
            pack = None
        if huge:
            for piece in _huge_section_pieces(section.text, path, strategy, count):
                yield path, piece
            continue
        if pieces is None:
            pieces = _section_pieces(section.text, path, strategy, count)
        if pieces == [section.text]:  # a small section: the next ones may join it
            pack = _Pack(heading_path, path, section.text)
            continue
        for piece in pieces:
            yield path, piece
    if pack is not None:
        yield pack.path, pack.text


def iter_chunks(
    sections: Iterable[Section],
    *,
    document_id: uuid.UUID,
    version_number: int,
    strategy: ChunkingStrategy,
    count_tokens: TokenCounter,
) -> Iterator[Chunk]:
    """The chunks of a document in order, each within ``strategy.max_tokens`` (heading
    prefix included), produced one section window at a time: a consumer that hands them on
    in slices never holds the whole document's chunks."""
    strategy_id = strategy.strategy_id
    for ordinal, (path, text) in enumerate(_chunk_texts(sections, strategy, count_tokens)):
        digest = hashlib.sha256(embedding_input_of(path, text).encode("utf-8")).digest()
        yield Chunk(
            chunk_id=chunk_id_of(
                document_id=document_id,
                version_number=version_number,
                strategy_id=strategy_id,
                ordinal=ordinal,
                heading_path=path,
                content_digest=digest,
            ),
            ordinal=ordinal,
            heading_path=path,
            text=text,
            content_digest=digest,
        )


def chunk_sections(
    sections: Iterable[Section],
    *,
    document_id: uuid.UUID,
    version_number: int,
    strategy: ChunkingStrategy,
    count_tokens: TokenCounter,
) -> list[Chunk]:
    """All of ``iter_chunks`` at once (small documents, tests)."""
    return list(
        iter_chunks(
            sections,
            document_id=document_id,
            version_number=version_number,
            strategy=strategy,
            count_tokens=count_tokens,
        )
    )
