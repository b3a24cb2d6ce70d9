"""The one rule for characters that hide or reorder text (issue 41), held by titles and by
principals wherever they come from (services.runtime.tenancy.hidden_characters)."""

from __future__ import annotations

import itertools
import sys
import unicodedata

import pytest

from services.embedding import HashingEmbedder, Vectors
from services.publisher.domain import check_principals, check_title
from services.runtime.errors import ValidationFailed
from services.runtime.tenancy.hidden_characters import (
    DEFAULT_IGNORABLE,
    hidden_character,
    is_hidden,
)
from services.runtime.tenancy.principals import normalise_principal, normalise_principals
from services.search.searcher import Candidates, Generation, Searcher, SearchRequest
from tests.unit.indexer.test_search import FakeIndex

# The characters the issue named, and their kin.
NAMED = [
    "\u00ad",  # soft hyphen
    "\u034f",  # combining grapheme joiner
    "\u061c",  # arabic letter mark
    "\u115f",  # hangul choseong filler
    "\u17b4",  # khmer vowel inherent aq
    "\u180b",  # mongolian free variation selector one
    "\u180e",  # mongolian vowel separator
    "\u200b",  # zero width space
    "\u200e",  # left-to-right mark
    "\u200f",  # right-to-left mark
    "\u202e",  # right-to-left override
    "\u2028",  # line separator
    "\u2029",  # paragraph separator
    "\u2064",  # invisible plus
    "\u2065",  # unassigned, reserved default-ignorable
    "\u2066",  # left-to-right isolate
    "\u206f",  # nominal digit shapes
    "\u2800",  # braille pattern blank
    "\u3164",  # hangul filler
    "\ufe00",  # variation selector-1
    "\ufe0f",  # variation selector-16
    "\ufeff",  # zero width no-break space (BOM)
    "\uffa0",  # halfwidth hangul filler
    "\ufff9",  # interlinear annotation anchor
    "\ufffe",  # noncharacter
    "\ufdd0",  # noncharacter
    "\U0001d173",  # musical symbol begin beam
    "\U0001fffe",  # noncharacter
    "\U000e0001",  # language tag
    "\U000e0041",  # tag latin capital letter a
    "\U000e007f",  # cancel tag
    "\U000e0100",  # variation selector-17
    "\ud800",  # a lone surrogate
    "\x00",
    "\x1b",
    "\x7f",
    "\x85",  # next line (C1)
]
VISIBLE = [
    "a",
    "Z",
    "0",
    " ",
    "\u00a0",
    "\u3000",
    "\u00e9",
    "e\u0301",
    "\u65e5",
    "\u0416",
    "\u05d0",
    "\u0627",
    "\U0001f4c4",
    "\u2013",
    "\ue000",
    "\u20ac",
    ":",
    "*",
    "%",
]


@pytest.mark.parametrize("ch", NAMED, ids=lambda ch: f"U+{ord(ch):04X}")
def test_each_named_character_is_hidden_and_refused_everywhere(ch: str) -> None:
    assert is_hidden(ch)
    assert hidden_character(f"group:{ch}support") == ch
    with pytest.raises(ValidationFailed) as title:
        check_title(f"Refund{ch}policy")
    assert title.value.code == "TITLE_INVALID"
    with pytest.raises(ValidationFailed) as principal:
        check_principals([f"group:support{ch}"])
    assert principal.value.code == "PRINCIPAL_INVALID"
    with pytest.raises(ValidationFailed) as searched:
        normalise_principals(["user:alice", f"group:{ch}support"])
    assert (searched.value.code, searched.value.http_status) == ("PRINCIPAL_INVALID", 422)


@pytest.mark.parametrize("text", VISIBLE)
def test_visible_text_is_kept(text: str) -> None:
    assert hidden_character(text) is None
    assert normalise_principal(f"group:{text}x") == unicodedata.normalize("NFC", f"group:{text}x")


def test_surrounding_whitespace_of_a_searched_principal_is_trimmed_not_refused() -> None:
    # Search always trimmed it (tests/integration/test_search_api.py); what is left is
    # checked, so whitespace never hides inside a principal.
    assert normalise_principals(["\tgroup:support\n", "\u2028group:hr\u2029 "]) == (
        "group:support",
        "group:hr",
    )
    with pytest.raises(ValidationFailed):
        normalise_principal("group:\tsupport")


def test_every_format_control_and_separator_character_is_hidden() -> None:
    missed = [
        f"U+{code:04X}"
        for code in range(sys.maxunicode + 1)
        if unicodedata.category(chr(code)) in {"Cc", "Cf", "Cs", "Zl", "Zp"}
        and not is_hidden(chr(code))
    ]
    assert missed == []


def test_only_blank_look_alikes_and_ignorables_are_hidden_among_visible_categories() -> None:
    """Outside the refused categories, a character is hidden only for being default
    ignorable, a noncharacter or U+2800: letters, marks, numbers, punctuation, symbols and
    spaces are otherwise kept."""
    unexpected = []
    for code in range(sys.maxunicode + 1):
        ch = chr(code)
        if unicodedata.category(ch) in {"Cc", "Cf", "Cs", "Zl", "Zp", "Cn"}:
            continue
        in_table = any(start <= code <= end for start, end in DEFAULT_IGNORABLE)
        if is_hidden(ch) != (in_table or ch == "\u2800"):
            unexpected.append(f"U+{code:04X}")
    assert unexpected == []


def test_the_default_ignorable_table_is_sorted_and_disjoint() -> None:
    for (start, end), (next_start, _) in itertools.pairwise(DEFAULT_IGNORABLE):
        assert start <= end < next_start


async def test_the_searcher_refuses_a_hidden_principal_before_the_index_is_asked() -> None:
    asked: list[SearchRequest] = []

    class RecordingIndex(FakeIndex):
        async def candidates(
            self, request: SearchRequest, query_vector: Vectors | None
        ) -> Candidates:
            asked.append(request)
            return await super().candidates(request, query_vector)

    embedder = HashingEmbedder(8)
    searcher = Searcher(embedder, RecordingIndex(Generation(embedder.model, 8)))
    with pytest.raises(ValidationFailed) as refused:
        await searcher.search(SearchRequest("acme", "refund", ("group:support\u00ad",)))
    assert refused.value.code == "PRINCIPAL_INVALID"
    assert asked == []


def test_a_key_cannot_be_bound_to_a_hidden_principal() -> None:
    from services.publisher.keys.cli import key_spec

    with pytest.raises(ValidationFailed) as refused:
        key_spec(["search"], ["group:support,group:\u00adhr"], False, None)
    assert refused.value.code == "PRINCIPAL_INVALID"


def test_every_ascii_character_is_judged_alone_as_amid_printable_text() -> None:
    # The all-printable-ASCII shortcut must agree with the rule character by character,
    # DEL and the C0 controls included.
    for code in range(0x80):
        ch = chr(code)
        expected = ch if is_hidden(ch) else None
        assert hidden_character(f"Refund {ch} policy") == expected, f"U+{code:04X}"
    assert hidden_character("group:support-EU_2 (ok)") is None
