"""Characters that hide or reorder text, refused in what a tenant names and others read or
compare: titles and principals (a principal that looks like another, a title that displays
otherwise than it reads).

The rule is by Unicode property, not a list of code points that the next bypass extends:

- general categories ``Cc`` (controls), ``Cf`` (format characters: soft hyphen, the bidi
  marks, embeddings, overrides and isolates, zero-width characters, word joiner, invisible
  operators, Arabic letter mark, Mongolian vowel separator, byte order mark, interlinear
  annotations, tag characters), ``Cs`` (a lone surrogate, which a JSON escape can carry but
  UTF-8 cannot store), ``Zl`` and ``Zp`` (line and paragraph separators);
- ``Default_Ignorable_Code_Point`` (Unicode's DerivedCoreProperties.txt): what a renderer
  draws as nothing although it is not ``Cf`` -- variation selectors, Hangul fillers, the
  combining grapheme joiner, Khmer inherent vowels, Mongolian free variation selectors --
  and the unassigned code points Unicode keeps for future invisible characters; the
  standard library does not expose the property, hence the table below;
- noncharacters (U+FDD0..U+FDEF and the last two code points of every plane);
- U+2800 BRAILLE PATTERN BLANK: a blank look-alike, the usual stand-in where the others
  are filtered.

Spaces (``Zs``) stay: they show as a gap, and trimming removes them at either end. Private
use and other unassigned code points stay too: they are visible (a box, or a character of a
newer Unicode than the server's).
"""

from __future__ import annotations

import bisect
import unicodedata
from typing import Final

REFUSED_CATEGORIES: Final = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})

# Default_Ignorable_Code_Point ranges (Unicode 15.1), the Cf ones among them included: the
# table stands on its own.
DEFAULT_IGNORABLE: Final[tuple[tuple[int, int], ...]] = (
    (0x00AD, 0x00AD),
    (0x034F, 0x034F),
    (0x061C, 0x061C),
    (0x115F, 0x1160),
    (0x17B4, 0x17B5),
    (0x180B, 0x180F),
    (0x200B, 0x200F),
    (0x202A, 0x202E),
    (0x2060, 0x206F),
    (0x3164, 0x3164),
    (0xFE00, 0xFE0F),
    (0xFEFF, 0xFEFF),
    (0xFFA0, 0xFFA0),
    (0xFFF0, 0xFFF8),
    (0x1BCA0, 0x1BCA3),
    (0x1D173, 0x1D17A),
    (0xE0000, 0xE0FFF),
)
_STARTS: Final = tuple(start for start, _ in DEFAULT_IGNORABLE)

BLANK_LOOKALIKES: Final = frozenset({"\u2800"})


def is_noncharacter(code: int) -> bool:
    return 0xFDD0 <= code <= 0xFDEF or (code & 0xFFFE) == 0xFFFE


def is_default_ignorable(code: int) -> bool:
    at = bisect.bisect_right(_STARTS, code) - 1
    return at >= 0 and code <= DEFAULT_IGNORABLE[at][1]


def is_hidden(ch: str) -> bool:
    """Whether ``ch`` (one character) hides or reorders text (the module's rule)."""
    code = ord(ch)
    if code < 0x7F and ch.isprintable():
        return False  # printable ASCII: the common case, without a table lookup
    return (
        unicodedata.category(ch) in REFUSED_CATEGORIES
        or is_default_ignorable(code)
        or is_noncharacter(code)
        or ch in BLANK_LOOKALIKES
    )


def hidden_character(text: str) -> str | None:
    """The first character of ``text`` that hides or reorders text, if any."""
    if text.isascii() and text.isprintable():
        # Printable ASCII only (U+0020..U+007E: DEL is not printable), the common title
        # and principal: none hides, and two C scans replace a call per character.
        return None
    return next((ch for ch in text if is_hidden(ch)), None)
