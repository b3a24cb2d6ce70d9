"""How a principal (``group:support``, ``user:alice``) is written when stored and compared.

Publish stores an ACL's principals in this form and search must ask in the same one: two
spellings of one principal (a precomposed "é" and "e" plus a combining accent, a stray space
around it) are one principal, or a reader would be refused a document the ACL names.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Iterable


def normalise_principal(principal: str) -> str:
    """``principal`` in Unicode NFC, trimmed of surrounding whitespace."""
    return unicodedata.normalize("NFC", principal).strip()


def normalise_principals(principals: Iterable[str]) -> tuple[str, ...]:
    """Each principal normalised, first occurrence kept, blanks dropped (a blank principal
    names nobody, and no ACL can hold one)."""
    seen: dict[str, None] = {}
    for principal in principals:
        normalised = normalise_principal(principal)
        if normalised:
            seen.setdefault(normalised)
    return tuple(seen)
