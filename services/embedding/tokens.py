"""How many tokens a text is, as the embedding model will see it.

Chunking counts tokens with the embedding model's own tokenizer, so a chunk never exceeds
what the model reads. A ``TokenizerSpec`` is plain data: it crosses a process boundary
(parsing and chunking run off the event loop) and names the tokenizer in the chunking
strategy's id.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

TokenCounter = Callable[[str], int]


@dataclass(frozen=True)
class TokenizerSpec:
    # Part of the chunking strategy id: a different tokenizer is a different index generation.
    name: str
    # A HuggingFace ``tokenizer.json``; ``None`` counts approximately (remote providers whose
    # tokenizer is not on this machine), erring on the high side.
    tokenizer_file: str | None
    # The most tokens the model reads of one input, its special tokens included (it
    # truncates the rest).
    max_input_tokens: int
    # Tokens the model adds to every input (BERT-style models: [CLS] and [SEP]). Chunks are
    # counted without them, so they must leave room for them.
    special_tokens: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.special_tokens < self.max_input_tokens:
            raise ValueError(
                f"tokenizer {self.name!r}: {self.special_tokens} special tokens do not fit in "
                f"{self.max_input_tokens} input tokens"
            )

    @property
    def max_counted_tokens(self) -> int:
        """The longest text, as ``load_token_counter`` counts it, that the model reads whole."""
        return self.max_input_tokens - self.special_tokens


def approximate_tokens(text: str) -> int:
    """A high estimate for BPE/WordPiece tokenizers: about one token per three characters."""
    return max(1, math.ceil(len(text) / 3)) if text else 0


@functools.lru_cache(maxsize=8)
def load_token_counter(spec: TokenizerSpec) -> TokenCounter:
    """A function counting the tokens of a text (without the special tokens the model adds).

    Loaded once per process and tokenizer: the embedding guard, chunking and the
    generations' budgets share it (a tokenizer file takes tens of milliseconds to load)."""
    if spec.tokenizer_file is None:
        return approximate_tokens
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(spec.tokenizer_file)
    # Counting must see the whole text: the file's baked-in padding and truncation are off.
    tokenizer.no_padding()
    tokenizer.no_truncation()

    def count(text: str) -> int:
        # The batch call without offsets: the same ids, and a sixth less time than encode.
        [encoding] = tokenizer.encode_batch_fast([text], add_special_tokens=False)
        return len(encoding.ids)

    return _ascii_wordpiece_counter(tokenizer, count) or count


# Characters the BERT normalizer deletes (controls other than tab, newline and return) or
# that need its Unicode handling: a text with any of them is counted by the tokenizer.
_NOT_PLAIN_ASCII = re.compile(r"[^\t\n\r\x20-\x7e]")
# The BERT pre-tokenizer on printable ASCII: runs of letters and digits, and every other
# non-space character (all ASCII punctuation, the underscore included) alone.
_ASCII_PIECES = re.compile(r"[A-Za-z0-9]+|[^A-Za-z0-9\s]")
_MAX_KNOWN_WORDS = 200_000


def _ascii_wordpiece_counter(tokenizer: Any, exact: TokenCounter) -> TokenCounter | None:
    """For a BERT WordPiece tokenizer (BertNormalizer, BertPreTokenizer, WordPiece), a
    counter of plain-ASCII texts that runs the normalizer and pre-tokenizer's rules in a
    regular expression and counts each word's pieces once (``exact`` counts the rest).

    The tokenizer's own normalizer keeps an alignment per character, which costs more than
    the word pieces do; on ASCII its rules come down to lower-casing and splitting, and a
    word's pieces never depend on its neighbours. The same count, several times faster
    (tests/unit/indexer/embedding/test_token_counter.py compares them). ``None`` for any
    other tokenizer."""
    from tokenizers import models, normalizers, pre_tokenizers

    normalizer = tokenizer.normalizer
    if not (
        isinstance(normalizer, normalizers.BertNormalizer)
        and normalizer.clean_text
        and isinstance(tokenizer.pre_tokenizer, pre_tokenizers.BertPreTokenizer)
        and isinstance(tokenizer.model, models.WordPiece)
    ):
        return None
    lowercase = bool(normalizer.lowercase)
    # Added tokens are matched before the word rules (in the text or, for some, in the
    # normalized text): a text holding one in any case (say, "[SEP]") is counted by the
    # tokenizer.
    added = tuple(token.content.lower() for token in tokenizer.get_added_tokens_decoder().values())
    model = tokenizer.model
    known: dict[str, int] = {}

    def count(text: str) -> int:
        if _NOT_PLAIN_ASCII.search(text):
            return exact(text)
        lowered = text.lower()
        if any(token in lowered for token in added):
            return exact(text)
        total = 0
        for word in _ASCII_PIECES.findall(lowered if lowercase else text):
            pieces = known.get(word)
            if pieces is None:
                if len(known) >= _MAX_KNOWN_WORDS:
                    known.clear()
                pieces = known[word] = len(model.tokenize(word))
            total += pieces
        return total

    return count
