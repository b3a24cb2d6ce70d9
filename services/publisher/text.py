"""Text a tenant sends that people will read or that is compared: titles and principals.

Stored and compared in NFC, so two spellings of one string (a precomposed "é" and "e" plus a
combining accent) are one title, one principal. Characters that hide or reorder text are
refused: C0/C1 controls, zero-width characters and bidirectional overrides/isolates (a
principal that looks like another, a title that displays differently than it reads).
"""

from __future__ import annotations

import unicodedata
from typing import Final

from services.runtime.errors import ValidationFailed

ZERO_WIDTH: Final = frozenset({"\u200b", "\u200c", "\u200d", "\u2060", "\ufeff"})
BIDI_CONTROLS: Final = frozenset(
    {"\u202a", "\u202b", "\u202c", "\u202d", "\u202e", "\u2066", "\u2067", "\u2068", "\u2069"}
)


def nfc(text: str) -> str:
    return unicodedata.normalize("NFC", text)


def forbidden_character(text: str) -> str | None:
    """The first control, zero-width or bidi-control character in ``text``, if any."""
    for ch in text:
        if ch in ZERO_WIDTH or ch in BIDI_CONTROLS or unicodedata.category(ch) == "Cc":
            return ch
    return None


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
