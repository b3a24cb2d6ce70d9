"""A document as the parsers hand it to chunking: sections, each under a heading path.

Every parser walks its format in document order and reports headings and blocks of text to
a ``SectionBuilder``; the builder keeps the stack of open headings, normalises whitespace
and drops sections without text, so all formats agree on what a section is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
# Invisible characters that only split words for a search: soft hyphen, zero-width space
# and joiners, word joiner, a BOM inside the text.
_INVISIBLE = re.compile("[\u00ad\u200b-\u200d\u2060\ufeff]")
_BLANK_LINES = re.compile(r"\n{3,}")


@dataclass(frozen=True)
class Section:
    heading_path: tuple[str, ...]  # ("Refund policy", "Window"); () before the first heading
    text: str  # the section's body text, whitespace-normalised, non-empty


def normalise_text(text: str) -> str:
    """Lines stripped, runs of spaces made one, at most one blank line in a row.

    Line breaks survive (they separate list items, table rows and paragraphs, which the
    chunker prefers to split on); control characters become spaces, invisible ones go."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _INVISIBLE.sub("", _CONTROL.sub(" ", text))
    # str.split() splits on exactly the characters \s matches: each line's runs of spaces
    # made one and its ends stripped, in C.
    lines = [" ".join(line.split()) for line in text.split("\n")]
    return _BLANK_LINES.sub("\n\n", "\n".join(lines)).strip()


def normalise_heading(title: str) -> str:
    """A heading is one line."""
    return " ".join(_INVISIBLE.sub("", _CONTROL.sub(" ", title)).split())


class SectionBuilder:
    """Collects blocks under the current heading path; a heading closes the open section.

    A heading of level ``n`` closes every open heading of level ``n`` or deeper, so a
    level-2 heading under a level-1 heading has the path ``(h1, h2)`` and a following
    level-1 heading starts again from ``(h1',)``."""

    def __init__(self) -> None:
        self._open: list[tuple[int, str]] = []
        self._blocks: list[str] = []
        self._sections: list[Section] = []

    def heading(self, level: int, title: str) -> None:
        self._flush()
        while self._open and self._open[-1][0] >= level:
            self._open.pop()
        title = normalise_heading(title)
        if title:
            self._open.append((level, title))

    def block(self, text: str) -> None:
        """One paragraph-like block; blocks of a section are separated by a blank line."""
        text = normalise_text(text)
        if text:
            self._blocks.append(text)

    def build(self) -> list[Section]:
        self._flush()
        return list(self._sections)

    def _flush(self) -> None:
        if self._blocks:
            path = tuple(title for _, title in self._open)
            self._sections.append(Section(path, "\n\n".join(self._blocks)))
            self._blocks = []
