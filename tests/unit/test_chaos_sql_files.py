"""The chaos run keeps its SQL as the services do (docs/architecture.md, "Where to find
it"): in ``.sql`` files under ``-- name:`` headers, loaded once, never in Python strings.
Each query also prepares against the migrated schema (tests/integration/test_migrations.py)."""

from __future__ import annotations

import ast
import re

from tests.support.stack import REPO_ROOT

CHAOS = REPO_ROOT / "kbtools" / "chaos"
# The start of a statement, not a word of prose ("DELETE with the revision ...").
STATEMENT = re.compile(
    r"^\s*(SELECT\s|WITH\s+\w+\s+AS\s*\(|INSERT\s+INTO\s|UPDATE\s+\w+\s+SET\s|DELETE\s+FROM\s)",
    re.IGNORECASE,
)


def statements(source: str) -> list[str]:
    """The string literals (f-strings too) of ``source`` that start a SQL statement."""
    found: dict[tuple[int, str], None] = {}  # an f-string's text is met again in its parts
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.JoinedStr | ast.Constant):
            continue
        parts = node.values if isinstance(node, ast.JoinedStr) else [node]
        text = "".join(
            p.value for p in parts if isinstance(p, ast.Constant) and isinstance(p.value, str)
        )
        if STATEMENT.match(text):
            found[(node.lineno, text.strip())] = None
    return [text for _, text in sorted(found)]


def test_no_chaos_module_holds_a_sql_statement() -> None:
    found = {
        str(path.relative_to(REPO_ROOT)): held
        for path in sorted(CHAOS.rglob("*.py"))
        if (held := statements(path.read_text(encoding="utf-8")))
    }
    assert found == {}


def test_the_scan_sees_a_statement_and_not_prose() -> None:
    source = (
        'A = """\n  SELECT 1 FROM t\n"""\nB = f"DELETE FROM t WHERE x = {A}"\n'
        'C = "DELETE with the revision the publish answered"\n'
    )
    assert statements(source) == ["SELECT 1 FROM t", "DELETE FROM t WHERE x ="]
