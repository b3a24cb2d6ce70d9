"""The synthetic quality set: paragraphs of the Python standard library's docstrings.

Every module, class and function docstring of the stdlib's ``.py`` files (read with ``ast``;
tests, demos and vendored tools left out) and of its C modules (builtins and lib-dynload,
read with ``inspect``: str, math, itertools, ... have no ``.py``) is split into paragraphs.
A paragraph of prose of at least two sentences becomes a pair: its first sentence (5-40
words) is the query, the rest (10-220 words) the one relevant passage (grade 1).
Paragraphs that are code, doctest, tables or lists, tiny, or duplicates (the same query or
passage text twice) are skipped. The
selection is deterministic: candidates ordered by a hash of their text, the first N kept, so
the same Python version always gives the same set (the version is part of the report).

    uv run python -m bench.quality_stdlib --pairs 2000 [--write DIR]   # BEIR files
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib
import inspect
import json
import re
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SKIP_DIRS = frozenset(
    {
        "test",
        "tests",
        "idlelib",
        "lib2to3",
        "turtledemo",
        "ensurepip",
        "site-packages",
        "dist-packages",
        "__pycache__",
        "config-3.11-x86_64-linux-gnu",
        "pydoc_data",
    }
)
_SENTENCE_END = re.compile(r"(?<=[a-z0-9)\]'\"`][.!?])\s+(?=[A-Z(`'\"])")
# A full stop after these is not the end of a sentence.
_ABBREVIATIONS = ("e.g.", "i.e.", "etc.", "vs.", "cf.", "approx.", "resp.", "incl.", "no.")
_WORD = re.compile(r"[A-Za-z]{2,}")
MIN_QUERY_WORDS, MAX_QUERY_WORDS = 5, 40
MIN_PASSAGE_WORDS, MAX_PASSAGE_WORDS = 10, 220


@dataclass(frozen=True)
class Pair:
    pair_id: str  # also the passage's unit id
    source: str  # module.qualname the docstring belongs to
    query: str
    passage: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _files(root: Path) -> Iterator[Path]:
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if any(part in SKIP_DIRS or part.startswith("test") for part in parts[:-1]):
            continue
        if parts[-1].startswith("test_"):
            continue
        yield path


def _docstrings(path: Path, module: str) -> Iterator[tuple[str, str]]:
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError):
        return
    stack: list[tuple[ast.AST, str]] = [(tree, module)]
    while stack:
        node, name = stack.pop(0)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=True)
            if doc:
                yield name, doc
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                stack.append((child, f"{name}.{child.name}"))


def _c_module_names(root: Path) -> list[str]:
    names = set(sys.builtin_module_names)
    names.update(path.name.split(".")[0] for path in (root / "lib-dynload").glob("*.so"))
    return sorted(n for n in names if not n.startswith(("_test", "xx", "_ctypes_test")))


def _c_docstrings(root: Path) -> Iterator[tuple[str, str]]:
    for module_name in _c_module_names(root):
        try:
            module = importlib.import_module(module_name)
        except Exception:  # a module this build cannot import is skipped
            continue
        objects: list[tuple[str, object]] = [(module_name, module)]
        for name, value in sorted(vars(module).items()):
            if inspect.isclass(value) or inspect.isroutine(value):
                objects.append((f"{module_name}.{name}", value))
            if inspect.isclass(value):
                for member_name, member in sorted(vars(value).items()):
                    if inspect.isroutine(member) or inspect.ismethoddescriptor(member):
                        objects.append((f"{module_name}.{name}.{member_name}", member))
        for name, value in objects:
            doc = getattr(value, "__doc__", None)
            if isinstance(doc, str) and doc.strip():
                yield name, inspect.cleandoc(doc)


def _all_docstrings(root: Path) -> Iterator[tuple[str, str]]:
    for path in _files(root):
        module = ".".join(path.relative_to(root).with_suffix("").parts)
        yield from _docstrings(path, module.removesuffix(".__init__"))
    yield from _c_docstrings(root)


def _is_prose(paragraph: str) -> bool:
    lines = paragraph.splitlines()
    if any(
        line.startswith((" ", "\t", ">>>", "...", "-", "*", "+", "|", "=", ":", "#", "o "))
        for line in lines
    ):
        return False  # code, doctest, lists, tables, reST fields
    if re.search(r"^\s*\w[\w ]{0,30}\s--\s", paragraph, re.M):
        return False  # "name -- description" argument lists
    letters = sum(c.isalpha() for c in paragraph)
    return letters >= 0.75 * len(paragraph.replace(" ", "").replace("\n", ""))


def _split_pair(paragraph: str) -> tuple[str, str] | None:
    text = " ".join(paragraph.split())
    match = next(
        (
            m
            for m in _SENTENCE_END.finditer(text)
            if not text[: m.start()].lower().endswith(_ABBREVIATIONS)
        ),
        None,
    )
    if match is None:
        return None
    query, passage = text[: match.start()].strip(), text[match.end() :].strip()
    if not MIN_QUERY_WORDS <= len(_WORD.findall(query)) <= MAX_QUERY_WORDS:
        return None
    if not MIN_PASSAGE_WORDS <= len(_WORD.findall(passage)) <= MAX_PASSAGE_WORDS:
        return None
    return query, passage


def candidates(root: Path | None = None) -> list[Pair]:
    root = root or stdlib_root()
    seen_queries: set[str] = set()
    seen_passages: set[str] = set()
    pairs: list[Pair] = []
    for name, doc in _all_docstrings(root):
        for paragraph in re.split(r"\n\s*\n", doc):
            if not _is_prose(paragraph.strip()):
                continue
            split = _split_pair(paragraph.strip())
            if split is None:
                continue
            query, passage = split
            q_key, p_key = query.lower(), passage.lower()
            if q_key in seen_queries or p_key in seen_passages:
                continue
            seen_queries.add(q_key)
            seen_passages.add(p_key)
            digest = hashlib.sha256(f"{query}\n{passage}".encode()).hexdigest()
            pairs.append(Pair(f"py-{digest[:16]}", name, query, passage))
    return pairs


def select(pairs: list[Pair], n: int) -> list[Pair]:
    """N pairs in an order that depends only on their text (spread over the whole stdlib)."""
    return sorted(pairs, key=lambda p: p.pair_id)[:n]


def write_beir(pairs: list[Pair], directory: Path) -> None:
    (directory / "qrels").mkdir(parents=True, exist_ok=True)
    with (directory / "corpus.jsonl").open("w") as f:
        for p in pairs:
            row = {"_id": p.pair_id, "title": p.source, "text": p.passage}
            f.write(json.dumps(row) + "\n")
    with (directory / "queries.jsonl").open("w") as f:
        for p in pairs:
            f.write(json.dumps({"_id": p.pair_id, "text": p.query}) + "\n")
    with (directory / "qrels" / "test.tsv").open("w") as f:
        f.write("query-id\tcorpus-id\tscore\n")
        for p in pairs:
            f.write(f"{p.pair_id}\t{p.pair_id}\t1\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=2000)
    parser.add_argument("--write", help="write the set as BEIR files into this directory")
    args = parser.parse_args()
    found = candidates()
    chosen = select(found, args.pairs)
    print(f"python {sys.version.split()[0]}: {len(found)} candidate pairs, {len(chosen)} kept")
    if args.write:
        write_beir(chosen, Path(args.write))
    else:
        for p in chosen[:8]:
            print(f"\n[{p.source}]\nQ: {p.query}\nP: {p.passage[:300]}")


if __name__ == "__main__":
    main()
