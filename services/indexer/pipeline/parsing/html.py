"""HTML through selectolax's lexbor parser: the visible body text under its h1-h6 headings.

What a reader does not see is dropped with its whole subtree: scripts, styles, templates,
navigation, the page's header and footer (an article's own header stays), and elements
hidden by ``hidden``, ``aria-hidden="true"`` or an inline ``display: none`` (also inside
a heading, where permalink icons hide). The ``<title>`` is metadata, not body text.
The parser decodes entities; block elements start new lines, table rows read
``cell | cell``.
"""

from __future__ import annotations

import re
from typing import Any

from selectolax.lexbor import LexborHTMLParser

from services.indexer.pipeline.parsing.text import decode
from services.indexer.pipeline.section import Section, SectionBuilder
from services.indexer.task import ErrorCode, IndexingFailed
from services.runtime.errors import UnsupportedMediaType
from services.runtime.indexing.text_encodings import html_encoding

_DROPPED = frozenset(
    {
        "script",
        "style",
        "nav",
        "template",
        "noscript",
        "title",
        "head",
        "iframe",
        "object",
        "canvas",
    }
)
# A page's header and footer are chrome (the banner and contentinfo landmarks); inside an
# article or section they belong to it (its title, its byline) and are kept.
_PAGE_CHROME = frozenset({"header", "footer"})
_SECTIONING = frozenset({"article", "aside", "main", "section"})
_HEADINGS = {f"h{level}": level for level in range(1, 7)}
# Blocks that stand apart as paragraphs.
_PARAGRAPHS = frozenset(
    {
        "p",
        "div",
        "section",
        "article",
        "main",
        "aside",
        "blockquote",
        "pre",
        "table",
        "ul",
        "ol",
        "dl",
        "figure",
        "form",
        "fieldset",
        "address",
        "details",
        "hr",
    }
)
# Blocks that are one line of a paragraph.
_LINES = frozenset({"li", "dt", "dd", "caption", "figcaption", "summary", "tr"})
_CELLS = frozenset({"td", "th"})
_HIDDEN_STYLE = re.compile(r"display\s*:\s*none|visibility\s*:\s*hidden", re.IGNORECASE)
_WHITESPACE = re.compile(r"\s+")


def decode_html(content: bytes) -> str:
    """BOM first, then a ``<meta charset>`` near the top, else strict UTF-8 (HTML's rules,
    without guessing), by the publisher's allow-list of text encodings: a page naming
    anything else (``zlib``, ``utf-7``) fails DOCUMENT_PARSE_FAILED and is never decoded."""
    try:
        encoding, skip = html_encoding(content)
    except UnsupportedMediaType as refused:
        raise IndexingFailed(ErrorCode.DOCUMENT_PARSE_FAILED, refused.message) from None
    return decode(content, encoding, skip=skip)


def _hidden(node: Any) -> bool:
    attributes: dict[str, str | None] = node.attributes
    if "hidden" in attributes:
        return True
    if (attributes.get("aria-hidden") or "").strip().lower() == "true":
        return True
    return bool(_HIDDEN_STYLE.search(attributes.get("style") or ""))


def _visible_text(root: Any) -> str:
    parts: list[str] = []
    stack = [root]
    while stack:
        node = stack.pop()
        if node.tag == "-text":
            parts.append(node.text_content or "")
            continue
        if node.tag.startswith("-") or node.tag in _DROPPED or _hidden(node):
            continue
        children = []
        child = node.child
        while child is not None:
            children.append(child)
            child = child.next
        stack.extend(reversed(children))
    return "".join(parts)


class _Walk:
    def __init__(self) -> None:
        self.builder = SectionBuilder()
        self.lines: list[str] = []
        self.inline: list[str] = []
        self.rows: list[list[str]] = []
        self.cell_depth = 0
        self.pre_depth = 0
        self.ordinals: list[int | None] = []
        self.sectioning_depth = 0

    # -- output -------------------------------------------------------------------------
    def end_line(self) -> None:
        text = "".join(self.inline).strip()
        self.inline = []
        if text:
            self.lines.append(text)

    def end_block(self) -> None:
        self.end_line()
        if self.lines:
            self.builder.block("\n".join(self.lines))
            self.lines = []

    # -- traversal ----------------------------------------------------------------------
    def enter(self, node: Any) -> bool:
        """Handles the start of ``node``; False skips its subtree."""
        tag: str = node.tag
        if tag == "-text":
            text: str = node.text_content or ""
            self.inline.append(text if self.pre_depth else _WHITESPACE.sub(" ", text))
            return False
        if tag.startswith("-") or tag in _DROPPED or _hidden(node):
            return False
        if tag in _PAGE_CHROME and not self.sectioning_depth:
            return False
        if tag in _SECTIONING:
            self.sectioning_depth += 1
        if self.cell_depth and tag not in _CELLS and tag != "tr":
            # Inside a table cell every block is just more of the cell.
            if tag in _PARAGRAPHS or tag in _LINES or tag == "br" or tag in _HEADINGS:
                self.inline.append(" ")
            return True
        if tag in _HEADINGS:
            self.end_block()
            self.builder.heading(_HEADINGS[tag], _visible_text(node))
            return False
        if tag == "br":
            self.end_line()
        elif tag in _PARAGRAPHS:
            self.end_block()
        elif tag in _LINES:
            self.end_line()
        if tag == "pre":
            self.pre_depth += 1
        elif tag == "ul":
            self.ordinals.append(None)
        elif tag == "ol":
            self.ordinals.append(0)
        elif tag == "li":
            self.list_marker()
        elif tag == "tr":
            self.rows.append([])
        elif tag in _CELLS:
            self.end_line()
            self.cell_depth += 1
        return True

    def list_marker(self) -> None:
        if not self.ordinals or self.ordinals[-1] is None:
            self.inline.append("- ")
            return
        self.ordinals[-1] += 1
        self.inline.append(f"{self.ordinals[-1]}. ")

    def exit(self, node: Any) -> None:
        tag: str = node.tag
        if tag in _SECTIONING:
            self.sectioning_depth -= 1
        if tag in _CELLS and self.cell_depth:
            self.cell_depth -= 1
            cell = " ".join("".join(self.inline).split())
            self.inline = []
            if self.rows:
                self.rows[-1].append(cell)
            return
        if self.cell_depth:
            return
        if tag == "tr" and self.rows:
            cells = self.rows.pop()
            self.end_line()
            if any(cells):
                self.lines.append(" | ".join(cells))
        elif tag == "pre":
            self.pre_depth -= 1
        elif tag in ("ul", "ol") and self.ordinals:
            self.ordinals.pop()
        if tag in _PARAGRAPHS:
            self.end_block()
        elif tag in _LINES:
            self.end_line()


def parse_html(content: bytes) -> list[Section]:
    body = LexborHTMLParser(decode_html(content)).body
    walk = _Walk()
    # Iterative: a deeply nested page must not exhaust the recursion limit.
    stack: list[tuple[Any, bool]] = [(body, False)] if body is not None else []
    while stack:
        node, leaving = stack.pop()
        if leaving:
            walk.exit(node)
            continue
        if node is not body and not walk.enter(node):
            continue
        stack.append((node, True))
        children = []
        child = node.child
        while child is not None:
            children.append(child)
            child = child.next
        stack.extend((child, False) for child in reversed(children))
    walk.end_block()
    return walk.builder.build()
