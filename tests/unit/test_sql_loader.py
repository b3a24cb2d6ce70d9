from __future__ import annotations

from pathlib import Path

import pytest

from services.runtime.sql import load_queries, parse_queries


def test_named_queries_are_split_on_their_headers() -> None:
    text = """
-- A file comment.
-- name: claim_tasks
-- Explains the locking.
SELECT 1;

-- name: heartbeat
UPDATE t SET x = 1
"""
    queries = parse_queries(text)
    assert list(queries) == ["claim_tasks", "heartbeat"]
    assert queries["claim_tasks"].endswith("SELECT 1")
    assert queries["heartbeat"] == "UPDATE t SET x = 1"


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("SELECT 1", "no '-- name"),
        ("-- name: a\nSELECT 1\n-- name: a\nSELECT 2", "defined twice"),
        ("-- name: a\n-- only a comment\n", "empty"),
        ("SELECT 0;\n-- name: a\nSELECT 1", "before the first"),
    ],
)
def test_malformed_query_files_are_rejected(text: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_queries(text)


def test_files_are_loaded_once_and_unknown_names_are_clear(tmp_path: Path) -> None:
    path = tmp_path / "queries.sql"
    path.write_text("-- name: one\nSELECT 1\n")
    first = load_queries(path)
    path.write_text("-- name: two\nSELECT 2\n")
    assert load_queries(path) is first
    with pytest.raises(KeyError, match="no query named 'two'"):
        first["two"]
