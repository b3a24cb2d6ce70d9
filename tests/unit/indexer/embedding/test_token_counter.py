"""The token counter's plain-ASCII path against the tokenizer itself: the same count for
every text, whichever path counts it."""

from __future__ import annotations

import json
import random
import string
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from services.embedding.onnx_local import default_tokenizer_file
from services.embedding.tokens import TokenizerSpec, load_token_counter


def _tokenizer_count(tokenizer_file: str, text: str) -> int:
    tokenizer = Tokenizer.from_file(tokenizer_file)
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return len(tokenizer.encode(text, add_special_tokens=False).ids)


def _random_texts(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    words = ["refund", "Policy", "ISO-27001", "e-mail", "snake_case", "x" * 120, "naïve", "数据"]
    alphabet = string.printable + "\x00\x01\x0b\x0c\x1f\x7f\u00a0\u2003é😀"
    texts = []
    for _ in range(count):
        parts = []
        for _ in range(rng.randint(0, 40)):
            roll = rng.random()
            if roll < 0.5:
                parts.append(rng.choice(words))
            elif roll < 0.9:
                parts.append(
                    "".join(rng.choice(string.printable) for _ in range(rng.randint(1, 12)))
                )
            else:
                parts.append("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))))
        texts.append(rng.choice([" ", "\n", "", "\t"]).join(parts))
    return texts


EDGES = [
    "",
    " ",
    "Refund within 30 days; see §4.",
    "under_score and CamelCase, 3.14 and a/b\\c",
    "[SEP] inside, [CLS] too and [MASK]",
    "[sep] in lower case is plain text",
    "a word longer than a hundred characters: " + "abc" * 40,
    "tab\tnew\nline\rreturn",
    "vertical\x0btab and form\x0cfeed are deleted, not spaces",
    "del\x7fete and bell\x07",
    "naïve café",
    "中文 mixed with ASCII",
]


@pytest.fixture(scope="module")
def spec() -> TokenizerSpec:
    return TokenizerSpec("minilm", str(default_tokenizer_file()), 256, 2)


@pytest.mark.parametrize("text", EDGES)
def test_edge_texts_count_as_the_tokenizer_does(spec: TokenizerSpec, text: str) -> None:
    assert spec.tokenizer_file is not None
    assert load_token_counter(spec)(text) == _tokenizer_count(spec.tokenizer_file, text)


def test_random_texts_count_as_the_tokenizer_does(spec: TokenizerSpec) -> None:
    assert spec.tokenizer_file is not None
    count = load_token_counter(spec)
    texts = _random_texts(seed=26, count=600)
    tokenizer = Tokenizer.from_file(spec.tokenizer_file)
    tokenizer.no_padding()
    tokenizer.no_truncation()
    expected = [len(tokenizer.encode(text, add_special_tokens=False).ids) for text in texts]
    # Twice: the second time from the counter's memory of each word's pieces.
    assert [count(text) for text in texts] == expected
    assert [count(text) for text in texts] == expected


def test_a_cased_bert_tokenizer_keeps_its_case(spec: TokenizerSpec, tmp_path: Path) -> None:
    assert spec.tokenizer_file is not None
    config = json.loads(Path(spec.tokenizer_file).read_text(encoding="utf-8"))
    config["normalizer"]["lowercase"] = False
    cased = tmp_path / "tokenizer.json"
    cased.write_text(json.dumps(config), encoding="utf-8")
    count = load_token_counter(TokenizerSpec("cased", str(cased), 256, 2))
    for text in ["Refund Policy", "REFUND", "refund", *_random_texts(seed=7, count=100)]:
        assert count(text) == _tokenizer_count(str(cased), text)
