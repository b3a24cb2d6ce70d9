"""Named SQL: every query lives in a ``.sql`` file under a ``-- name: <query>`` header.

Files are read once per process. Queries stay readable, diffable and greppable, a fake
adapter can route on the name, and a test prepares every one of them against the migrated
schema so that SQL and migrations cannot drift apart unnoticed.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from functools import cache
from pathlib import Path

_HEADER = re.compile(r"^--\s*name:\s*(?P<name>[a-z_][a-z0-9_]*)\s*$", re.MULTILINE)
# A line of its own naming another query of the same file, which takes its place (indented
# as the line is): one text for a part two statements share, each of them still whole.
_INCLUDE = re.compile(
    r"^(?P<indent>[ \t]*)--\s*include:\s*(?P<name>[a-z_][a-z0-9_]*)\s*$", re.MULTILINE
)


class Queries(Mapping[str, str]):
    """A read-only mapping ``query name -> SQL text`` loaded from one file."""

    def __init__(self, source: Path, queries: dict[str, str]) -> None:
        self.source = source
        self._queries = queries

    def __getitem__(self, name: str) -> str:
        try:
            return self._queries[name]
        except KeyError:
            raise KeyError(f"no query named {name!r} in {self.source}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._queries)

    def __len__(self) -> int:
        return len(self._queries)


def parse_queries(text: str, *, source: str = "<string>") -> dict[str, str]:
    headers = list(_HEADER.finditer(text))
    if not headers:
        raise ValueError(f"{source}: no '-- name: ...' header found")
    if text[: headers[0].start()].strip() and not _only_comments(text[: headers[0].start()]):
        raise ValueError(f"{source}: SQL before the first '-- name:' header")
    queries: dict[str, str] = {}
    for index, header in enumerate(headers):
        end = headers[index + 1].start() if index + 1 < len(headers) else len(text)
        body = text[header.end() : end].strip()
        name = header.group("name")
        if name in queries:
            raise ValueError(f"{source}: query {name!r} defined twice")
        if not body or _only_comments(body):
            raise ValueError(f"{source}: query {name!r} is empty")
        queries[name] = body.rstrip(";").rstrip()
    return {name: _expand(name, queries, (), source) for name in queries}


def _expand(name: str, queries: dict[str, str], including: tuple[str, ...], source: str) -> str:
    if name in including:
        raise ValueError(f"{source}: query {name!r} includes itself")

    def included(match: re.Match[str]) -> str:
        target = match.group("name")
        if target not in queries:
            raise ValueError(f"{source}: query {name!r} includes unknown query {target!r}")
        body = _expand(target, queries, (*including, name), source)
        return indented(body, match.group("indent"))

    return _INCLUDE.sub(included, queries[name])


def indented(text: str, indent: str) -> str:
    """``text`` as an include line indented by ``indent`` puts it into a query (blank lines
    stay blank)."""
    return "\n".join(indent + line if line else line for line in text.splitlines())


def _only_comments(text: str) -> bool:
    return all(not line.strip() or line.strip().startswith("--") for line in text.splitlines())


@cache
def load_queries(path: Path) -> Queries:
    return Queries(path, parse_queries(path.read_text(encoding="utf-8"), source=str(path)))


def queries_beside(module_file: str, filename: str = "queries.sql") -> Queries:
    """The named queries in ``filename`` next to the calling module (``__file__``)."""
    return load_queries(Path(module_file).resolve().parent / filename)


def all_query_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.sql") if "__pycache__" not in p.parts)
