"""docs/architecture.md names only paths that exist.

Its "Where to find it" table is how a reader gets from a rule to the code that keeps it;
a file renamed or moved without the page following sends them nowhere. Every backticked
path under ``services/``, ``kbtools/``, ``migrations/``, ``schemas/`` or ``tests/`` must name
a file or folder of the repository (a glob such as ``schemas/*.avsc`` must match at least
one), in the table and in the rest of the page; and every relative link must reach a file. Names
written relative to a room (``queue/worker.py`` under "The indexer") are not checked: the
paragraph they stand in says which room.
"""

from __future__ import annotations

import re
from pathlib import Path

from tests.support.stack import REPO_ROOT

DOC = REPO_ROOT / "docs" / "architecture.md"
CHECKED_ROOTS = ("services", "kbtools", "migrations", "schemas", "tests")
TABLE = "## Where to find it"

_PATH = re.compile(r"`((?:" + "|".join(CHECKED_ROOTS) + r")/[^`\s]*)`")
# [text](target): a relative target, without its #fragment.
_LINK = re.compile(r"\]\((?!https?:|mailto:|#)([^)#\s]+)(?:#[^)\s]*)?\)")


def section(text: str, heading: str) -> str:
    """The lines from ``heading`` up to the next heading of its level."""
    start = text.index(heading + "\n")
    level = heading.split(" ", 1)[0]
    end = text.find("\n" + level + " ", start + len(heading))
    return text[start : end if end != -1 else len(text)]


def named_paths(text: str) -> list[str]:
    return list(dict.fromkeys(_PATH.findall(text)))


def missing_paths(text: str, root: Path) -> list[str]:
    """The backticked repository paths in ``text`` that name nothing under ``root``."""
    found = []
    for path in named_paths(text):
        # A trailing colon or comma sits outside the backticks; a trailing slash says folder.
        cleaned = path.rstrip("/")
        if any(c in cleaned for c in "*?["):
            exists = any(root.glob(cleaned))
        else:
            exists = (root / cleaned).exists()
        if not exists:
            found.append(path)
    return found


def broken_links(text: str, page: Path) -> list[str]:
    return [t for t in dict.fromkeys(_LINK.findall(text)) if not (page.parent / t).exists()]


def test_the_where_to_find_it_table_names_only_paths_that_exist() -> None:
    table = section(DOC.read_text(encoding="utf-8"), TABLE)
    # The table was found and holds paths: an empty match would pass for nothing.
    assert len(named_paths(table)) >= 20
    assert missing_paths(table, REPO_ROOT) == []


def test_the_page_names_only_paths_that_exist() -> None:
    text = DOC.read_text(encoding="utf-8")
    assert missing_paths(text, REPO_ROOT) == []


def test_the_page_links_only_to_files_that_exist() -> None:
    assert broken_links(DOC.read_text(encoding="utf-8"), DOC) == []


def test_a_planted_wrong_path_in_the_table_fails(tmp_path: Path) -> None:
    text = DOC.read_text(encoding="utf-8")
    table = section(text, TABLE)
    planted = table.replace(
        "`services/indexer/queue/worker.py`", "`services/indexer/queue/workers.py`", 1
    )
    assert planted != table
    assert missing_paths(planted, REPO_ROOT) == ["services/indexer/queue/workers.py"]
    row = "| The nothing | `migrations/9999_nothing.sql`, `schemas/*.proto`, `tests/nowhere/` |\n"
    assert missing_paths(table + row, REPO_ROOT) == [
        "migrations/9999_nothing.sql",
        "schemas/*.proto",
        "tests/nowhere/",
    ]
    # The whole page's check sees the planted row too, wherever it stands.
    assert missing_paths(text.replace(TABLE + "\n", TABLE + "\n" + row), REPO_ROOT) == [
        "migrations/9999_nothing.sql",
        "schemas/*.proto",
        "tests/nowhere/",
    ]


def test_a_planted_broken_link_fails() -> None:
    assert broken_links("see [gone](gone.md#x) and [ok](security.md)", DOC) == ["gone.md"]
