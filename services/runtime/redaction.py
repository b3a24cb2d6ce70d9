"""Masking credentials in text meant for people: CLI error messages, logs, stored errors.

Two nets: patterns (a password inside a URL, ``password=...``/``api_key: ...`` pairs,
bearer tokens, and whatever has the shape of our own credentials: a tenant key
``kb.<tenant>.<secret>`` keeps its tenant, an operator key ``kbop.<secret>`` its prefix, a JWT
is masked whole) and the environment itself -- the value of every variable whose name says it
is a secret, and the password of every URL held in the environment, is masked wherever it
appears, whatever the message looks like around it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from typing import Final
from urllib.parse import unquote, urlsplit

MASK: Final = "***"

_PATTERNS: Final = (
    re.compile(r"(?i)(bearer\s+)[A-Za-z0-9._~+/=-]+"),
    # Our own credentials by shape, wherever they appear (a repr, an error message).
    re.compile(r"(?<![A-Za-z0-9_.-])(kb\.[a-z0-9][a-z0-9-]{0,62}\.)[A-Za-z0-9_-]{16,}"),
    re.compile(r"(?<![A-Za-z0-9_.-])(kbop\.)[A-Za-z0-9_-]{16,}"),
    re.compile(r"()\beyJ[A-Za-z0-9_-]*\.[A-Za-z0-9_-]*\.[A-Za-z0-9_-]+"),
    re.compile(
        r"(?i)((?:api[_-]?key|token|secret|password|passwd|pwd|credentials)[\"']?\s*[:=]\s*[\"']?)"
        r"[^\s,\"'&;]+"
    ),
    # scheme://user:password@host -- the password may hold anything but '@' and whitespace.
    # Every part is bounded and the scheme starts where a word does: otherwise text made of
    # many near-URLs ('a://a://...') would take time quadratic in its length.
    re.compile(r"(?i)((?<![a-z0-9+.-])[a-z][a-z0-9+.-]{0,31}://[^/\s:@]{0,256}:)[^@\s]{1,256}(@)"),
)

# Every pattern above needs one of these to match (case aside: a superset is safe). Most of
# what gets logged (ids, names, counts) holds none, and one search for them costs a sixth
# of running the patterns: an indexer at info level logs a few lines a document.
_WORDS: Final = r"bearer|kb\.|kbop\.|eyj|key|token|secret|passw|pwd|credentials|://"
_MAY_HOLD_CREDENTIAL: Final = re.compile(f"(?i){_WORDS}")
# ASCII text lower-cased, searched case-sensitively: five times faster than the search
# above, and exact (a case-blind match of ASCII text is ASCII case). Other text keeps the
# case-blind search, whose rules (the long s matches an s) a lower-casing would miss.
_MAY_HOLD_CREDENTIAL_ASCII: Final = re.compile(_WORDS)


def _may_hold_credential(text: str) -> bool:
    if text.isascii():
        return _MAY_HOLD_CREDENTIAL_ASCII.search(text.lower()) is not None
    return _MAY_HOLD_CREDENTIAL.search(text) is not None


_SECRET_NAME: Final = re.compile(r"(?i)(PASSWORD|PASSWD|SECRET|TOKEN|API_?KEY|PRIVATE_KEY)")
# Shorter values would mask ordinary words all over the text.
_MIN_SECRET_LENGTH: Final = 4


def environment_secrets(environ: Mapping[str, str] | None = None) -> frozenset[str]:
    """Secret values held in the environment: variables named like secrets, and the
    password part of every URL-valued variable (DATABASE_URL and friends)."""
    env = os.environ if environ is None else environ
    found: set[str] = set()
    for name, value in env.items():
        if not value:
            continue
        if _SECRET_NAME.search(name):
            found.add(value)
        if "://" in value and "@" in value:
            try:
                password = urlsplit(value.strip()).password
            except ValueError:
                password = None
            if password:
                found.update({password, unquote(password)})
    return frozenset(s for s in found if len(s) >= _MIN_SECRET_LENGTH)


def redact(text: str, *, secrets: Iterable[str] | None = None) -> str:
    """``text`` with credentials masked. ``secrets`` defaults to the environment's."""
    known = environment_secrets() if secrets is None else secrets
    # Longest first: a secret that contains another is masked whole.
    for secret in sorted(known, key=len, reverse=True):
        if secret:
            text = text.replace(secret, MASK)
    if not _may_hold_credential(text):
        return text
    for pattern in _PATTERNS:
        text = pattern.sub(
            lambda m: m.group(1) + MASK + (m.group(2) if m.lastindex == 2 else ""), text
        )
    return text
