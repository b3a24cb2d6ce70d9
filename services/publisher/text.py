"""Text a tenant sends that people will read or that is compared: titles and principals.

Stored and compared in NFC, so two spellings of one string (a precomposed "é" and "e" plus a
combining accent) are one title, one principal. Characters that hide or reorder text are
refused by the rule principals are held to everywhere
(:mod:`services.runtime.tenancy.hidden_characters`): controls, format characters (zero-width,
bidi marks, embeddings, overrides and isolates, soft hyphen, tags...), line and paragraph
separators, lone surrogates, noncharacters, variation selectors and every other
default-ignorable code point, and U+2800 BRAILLE PATTERN BLANK. The API's descriptions of
titles and principals say so in :data:`REFUSED_CHARACTERS`.
"""

from __future__ import annotations

import unicodedata
from typing import Final

from services.runtime.errors import ValidationFailed
from services.runtime.tenancy.hidden_characters import hidden_character

# The rule in the API's own words (the title's and the ACL's descriptions in openapi.json).
REFUSED_CHARACTERS: Final = (
    "characters that hide or reorder text are refused: controls, format characters "
    "(zero-width, bidi marks, embeddings, overrides and isolates, soft hyphen, tags), line "
    "and paragraph separators, lone surrogates, noncharacters, every default-ignorable code "
    "point (variation selectors, Hangul fillers, ...) and U+2800 BRAILLE PATTERN BLANK"
)


def nfc(text: str) -> str:
    return unicodedata.normalize("NFC", text)


def forbidden_character(text: str) -> str | None:
    """The first character of ``text`` that hides or reorders text, if any."""
    return hidden_character(text)


def clean_text(text: str, *, what: str, max_length: int, code: str) -> str:
    """``text`` NFC-normalised and trimmed, or 422 (``code``) naming what is wrong."""
    bad = forbidden_character(text)
    if bad is not None:
        raise ValidationFailed(
            f"the {what} contains the invisible or control character U+{ord(bad):04X}",
            code=code,
        )
    cleaned = nfc(text).strip()
    if not cleaned:
        raise ValidationFailed(f"the {what} is blank", code=code)
    if len(cleaned) > max_length:
        raise ValidationFailed(f"the {what} is longer than {max_length} characters", code=code)
    return cleaned
