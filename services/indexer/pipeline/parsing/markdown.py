"""Markdown (CommonMark with tables) through markdown-it-py's token stream.

ATX and setext headings build the heading path; a ``#`` inside a code fence is code, not
a heading, because the tokenizer says so. Lists, tables, quotes and code become plain
lines: list items keep a marker, table rows read ``cell | cell``. YAML front matter is
metadata and skipped.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence

from markdown_it import MarkdownIt
from markdown_it.token import Token
from selectolax.lexbor import LexborHTMLParser

from services.indexer.pipeline.parsing.text import decode_text
from services.indexer.pipeline.section import Section, SectionBuilder

# YAML front matter is metadata; left in, its closing ``---`` would make a setext heading.
_FRONT_MATTER = re.compile(r"\A---[ \t]*\r?\n.*?\r?\n(?:---|\.\.\.)[ \t]*(?:\r?\n|\Z)", re.S)
_CONTAINERS_CLOSE = frozenset(
    {"bullet_list_close", "ordered_list_close", "table_close", "blockquote_close"}
)


# Built at first use and kept: building it (its rule chains, its renderer) took more of
# the indexer's CPU than parsing a short note does. A parse keeps its state (link
# references among it) in objects of its own, so documents share nothing through it.
_PARSER: MarkdownIt | None = None
_BUILDING = threading.Lock()
# markdown-it compiles a rule chain on its first use, publishing it empty before filling
# it, and ParsePool(inline=True) parses in several threads at once: one parse of this
# compiles the core, block, inline and inline2 chains before any thread can see the parser.
_WARM_UP = "# a\n\nb *c*\n"


def _markdown() -> MarkdownIt:
    global _PARSER
    parser = _PARSER
    if parser is None:
        with _BUILDING:
            parser = _PARSER
            if parser is None:
                parser = MarkdownIt("commonmark").enable(["table", "strikethrough"])
                parser.parse(_WARM_UP)
                _PARSER = parser
    return parser


def inline_text(children: Sequence[Token] | None) -> str:
    parts: list[str] = []
    for child in children or ():
        if child.type in ("text", "code_inline", "image"):
            # An image's content is its alt text.
            parts.append(child.content)
        elif child.type == "softbreak":
            parts.append(" ")
        elif child.type == "hardbreak":
            parts.append("\n")
    return "".join(parts)


def _html_text(html: str) -> str:
    body = LexborHTMLParser(html).body
    return body.text(separator=" ") if body is not None else ""


class _Walk:
    def __init__(self) -> None:
        self.builder = SectionBuilder()
        self.lines: list[str] = []
        self.heading_level: int | None = None
        self.cells: list[str] | None = None
        self.markers: list[str] = []
        self.pending_marker = ""

    def end_block(self) -> None:
        if self.lines:
            self.builder.block("\n".join(self.lines))
            self.lines = []

    def line(self, text: str) -> None:
        self.lines.append(self.pending_marker + text)
        self.pending_marker = ""

    def token(self, token: Token) -> None:
        kind = token.type
        if kind == "heading_open":
            self.end_block()
            self.heading_level = int(token.tag[1:])
        elif kind == "heading_close":
            self.heading_level = None
        elif kind == "inline":
            self.inline(token)
        elif kind == "bullet_list_open":
            self.markers.append("-")
        elif kind == "ordered_list_open":
            self.markers.append(".")
        elif kind in ("bullet_list_close", "ordered_list_close"):
            self.markers.pop()
        elif kind == "list_item_open":
            marker = self.markers[-1] if self.markers else "-"
            self.pending_marker = "- " if marker == "-" else f"{token.info}. "
        elif kind == "tr_open":
            self.cells = []
        elif kind == "tr_close":
            if self.cells is not None and any(self.cells):
                self.line(" | ".join(self.cells))
            self.cells = None
        elif kind in ("fence", "code_block"):
            self.code(token)
        elif kind == "html_block":
            self.line(_html_text(token.content))
        if token.level == 0 and (kind == "paragraph_close" or kind in _CONTAINERS_CLOSE):
            self.end_block()

    def inline(self, token: Token) -> None:
        text = inline_text(token.children)
        if self.heading_level is not None:
            self.builder.heading(self.heading_level, text)
        elif self.cells is not None:
            self.cells.append(" ".join(text.split()))
        else:
            self.line(text)

    def code(self, token: Token) -> None:
        if token.level == 0:
            self.end_block()
        self.line(token.content)
        if token.level == 0:
            self.end_block()


def parse_markdown(content: bytes) -> list[Section]:
    text = _FRONT_MATTER.sub("", decode_text(content), count=1)
    walk = _Walk()
    for token in _markdown().parse(text):
        walk.token(token)
    walk.end_block()
    return walk.builder.build()
