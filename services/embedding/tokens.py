"""How many tokens a text is, as the embedding model will see it.

Chunking counts tokens with the embedding model's own tokenizer, so a chunk never exceeds
what the model reads. A ``TokenizerSpec`` is plain data: it crosses a process boundary
(parsing and chunking run off the event loop) and names the tokenizer in the chunking
strategy's id.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

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


def load_token_counter(spec: TokenizerSpec) -> TokenCounter:
    """A function counting the tokens of a text (without the special tokens the model adds)."""
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

    return count
