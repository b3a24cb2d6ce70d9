"""How a principal (``group:support``, ``user:alice``) is written when stored and compared.

Publish stores an ACL's principals in this form and search must ask in the same one: two
spellings of one principal (a precomposed "é" and "e" plus a combining accent, a stray space
around it) are one principal, or a reader would be refused a document the ACL names.

A principal holding a character that hides or reorders text (``hidden_characters``) is
refused alike wherever it comes from -- a publish's ACL, a search's principals, a principal
token's, a key's fixed ones: 422 ``PRINCIPAL_INVALID``. No ACL can hold one, and a search
that silently dropped it would answer as if the caller were someone else.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Iterable
from typing import Final

from services.runtime.errors import ValidationFailed
from services.runtime.tenancy.hidden_characters import hidden_character

PRINCIPAL_INVALID: Final = "PRINCIPAL_INVALID"


def normalise_principal(principal: str) -> str:
    """``principal`` in Unicode NFC, trimmed of surrounding whitespace; 422
    ``PRINCIPAL_INVALID`` when what is left holds a hidden or control character."""
    normalised = unicodedata.normalize("NFC", principal).strip()
    bad = hidden_character(normalised)
    if bad is not None:
        raise ValidationFailed(
            f"a principal contains the invisible or control character U+{ord(bad):04X}",
            code=PRINCIPAL_INVALID,
        )
    return normalised


def normalise_principals(principals: Iterable[str]) -> tuple[str, ...]:
    """Each principal normalised, first occurrence kept, blanks dropped (a blank principal
    names nobody, and no ACL can hold one)."""
    seen: dict[str, None] = {}
    for principal in principals:
        normalised = normalise_principal(principal)
        if normalised:
            seen.setdefault(normalised)
    return tuple(seen)
