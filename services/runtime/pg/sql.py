"""Named SQL: every query lives in a ``.sql`` file under a ``-- name: <query>`` header.

Files are read once per process. Queries stay readable, diffable and greppable, a fake
adapter can route on the name, and a test prepares every one of them against the migrated
schema so that SQL and migrations cannot drift apart unnoticed.

A line ``-- include: <query>`` puts another query of the same file in its place;
``-- include: <query> from <file>`` one of another file, named from the directory that holds
the ``services`` package (``services/runtime/indexing/search_version.sql``): one text for what
several statements, of one service or of several, say alike.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from functools import cache
from pathlib import Path

_HEADER = re.compile(r"^--\s*name:\s*(?P<name>[a-z_][a-z0-9_]*)\s*$", re.MULTILINE)
# A line of its own naming another query, of the same file or (``from``) of another, which
# takes its place (indented as the line is): one text for a part two statements share, each
# of them still whole.
_INCLUDE = re.compile(
    r"^(?P<indent>[ \t]*)--\s*include:\s*(?P<name>[a-z_][a-z0-9_]*)"
    r"(?:\s+from\s+(?P<file>\S+))?\s*$",
    re.MULTILINE,
)
# Where the files an include names are found: the directory holding the services package.
_ROOT = Path(__file__).resolve().parents[3]

# The queries of another file, by the name an include gives it.
OtherFile = Callable[[str], Mapping[str, str]]


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


def parse_queries(
    text: str, *, source: str = "<string>", other_file: OtherFile | None = None
) -> dict[str, str]:
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
    return {name: _expand(name, queries, (), source, other_file) for name in queries}


def _expand(
    name: str,
    queries: dict[str, str],
    including: tuple[str, ...],
    source: str,
    other_file: OtherFile | None,
) -> str:
    if name in including:
        raise ValueError(f"{source}: query {name!r} includes itself")

    def included(match: re.Match[str]) -> str:
        target, file = match.group("name"), match.group("file")
        if file is not None:
            if other_file is None:
                raise ValueError(f"{source}: query {name!r} includes a query of {file}")
            others = other_file(file)
            if target not in others:
                raise ValueError(
                    f"{source}: query {name!r} includes unknown query {target!r} of {file}"
                )
            body = others[target]
        elif target not in queries:
            raise ValueError(f"{source}: query {name!r} includes unknown query {target!r}")
        else:
            body = _expand(target, queries, (*including, name), source, other_file)
        return indented(body, match.group("indent"))

    return _INCLUDE.sub(included, queries[name])


def indented(text: str, indent: str) -> str:
    """``text`` as an include line indented by ``indent`` puts it into a query (blank lines
    stay blank)."""
    return "\n".join(indent + line if line else line for line in text.splitlines())


def _only_comments(text: str) -> bool:
    return all(not line.strip() or line.strip().startswith("--") for line in text.splitlines())


# The files being loaded, in order: a file that includes from one of them is a cycle.
_loading: list[Path] = []


@cache
def load_queries(path: Path) -> Queries:
    if path in _loading:
        chain = " -> ".join(str(p) for p in [*_loading[_loading.index(path) :], path])
        raise ValueError(f"query files include each other: {chain}")
    _loading.append(path)
    try:
        text = path.read_text(encoding="utf-8")
        return Queries(path, parse_queries(text, source=str(path), other_file=_load_other))
    finally:
        _loading.pop()


def _load_other(file: str) -> Queries:
    return load_queries((_ROOT / file).resolve())


def queries_beside(module_file: str, filename: str = "queries.sql") -> Queries:
    """The named queries in ``filename`` next to the calling module (``__file__``)."""
    return load_queries(Path(module_file).resolve().parent / filename)


def all_query_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.sql") if "__pycache__" not in p.parts)
