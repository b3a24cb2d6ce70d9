"""Titles and principals: NFC, and no characters that hide or reorder text."""

from __future__ import annotations

import asyncio
import unicodedata

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.publisher.domain import Publisher, Upload, check_principals, check_title
from services.publisher.text import clean_text, forbidden_character
from services.runtime.errors import ValidationFailed
from services.runtime.tenancy.hidden_characters import is_hidden
from tests.fakes.publisher_store import MemoryPublisherStore

ZERO_WIDTH = frozenset({"\u200b", "\u200c", "\u200d", "\u2060", "\ufeff"})
BIDI_CONTROLS = frozenset(
    {chr(c) for c in range(0x202A, 0x202F)}
    | {chr(c) for c in range(0x2066, 0x206A)}
    | {"\u200e", "\u200f", "\u061c"}
)
HIDDEN = [*sorted(ZERO_WIDTH | BIDI_CONTROLS), "\x00", "\x07", "\n", "\x1b", "\x7f", "\x85"]


@pytest.mark.parametrize("hidden", HIDDEN)
def test_hidden_and_control_characters_are_refused(hidden: str) -> None:
    for text in (f"Refunds{hidden}", f"{hidden}Refunds", f"Re{hidden}funds"):
        with pytest.raises(ValidationFailed) as title:
            check_title(text)
        assert title.value.code == "TITLE_INVALID"
        assert title.value.http_status == 422
        with pytest.raises(ValidationFailed) as principal:
            check_principals(["group:support", f"group:{hidden}admins"])
        assert principal.value.code == "PRINCIPAL_INVALID"


def test_composed_and_decomposed_spellings_are_one() -> None:
    composed, decomposed = "Caf\u00e9", "Cafe\u0301"
    assert composed != decomposed
    assert check_title(decomposed) == composed
    assert check_principals([composed, decomposed, f" {decomposed} "]) == frozenset({composed})


_visible = st.text(
    alphabet=st.characters(blacklist_categories=("Cc", "Cf", "Cs", "Zl", "Zp")).filter(
        lambda ch: not is_hidden(ch)
    ),
    min_size=1,
    max_size=40,
)


@given(_visible)
def test_clean_text_is_nfc_idempotent_and_never_keeps_a_hidden_character(text: str) -> None:
    try:
        cleaned = clean_text(text, what="t", max_length=500, code="X")
    except ValidationFailed:
        assert not unicodedata.normalize("NFC", text).strip()
        return
    assert unicodedata.is_normalized("NFC", cleaned)
    assert clean_text(cleaned, what="t", max_length=500, code="X") == cleaned
    assert forbidden_character(cleaned) is None


@given(_visible, st.sampled_from(HIDDEN), st.integers(min_value=0, max_value=40))
def test_a_hidden_character_anywhere_is_refused(text: str, hidden: str, at: int) -> None:
    with pytest.raises(ValidationFailed):
        clean_text(text[:at] + hidden + text[at:], what="t", max_length=500, code="X")


def test_publishing_the_same_acl_in_another_normal_form_is_a_repeat() -> None:
    async def run() -> None:
        store = MemoryPublisherStore()
        store.add_tenant("acme", "standard", b"\x00" * 32)
        publisher = Publisher(store, max_upload_bytes=1024)
        created = await publisher.create_document("acme", "Doc", Upload(b"x", "text/plain", None))
        first = await publisher.publish(
            "acme", created.document_id, 1, expected_revision=1, read_principals=["Caf\u00e9"]
        )
        again = await publisher.publish(
            "acme", created.document_id, 1, expected_revision=1, read_principals=["Cafe\u0301"]
        )
        assert first.changed
        assert not again.changed
        assert again.index_task_id == first.index_task_id
        assert len(store.events()) == 2

    asyncio.run(run())
