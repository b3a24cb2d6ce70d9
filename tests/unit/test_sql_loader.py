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


def test_an_included_query_takes_the_place_of_its_line_indented_as_it_is() -> None:
    text = """
-- name: shared_part
-- Which rows.
SELECT x
  FROM t

-- name: whole
WITH part AS (
    -- include: shared_part
)
SELECT * FROM part
"""
    queries = parse_queries(text)
    assert queries["shared_part"] == "-- Which rows.\nSELECT x\n  FROM t"
    assert queries["whole"] == (
        "WITH part AS (\n    -- Which rows.\n    SELECT x\n      FROM t\n)\nSELECT * FROM part"
    )


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("SELECT 1", "no '-- name"),
        ("-- name: a\nSELECT 1\n-- name: a\nSELECT 2", "defined twice"),
        ("-- name: a\n-- only a comment\n", "empty"),
        ("SELECT 0;\n-- name: a\nSELECT 1", "before the first"),
        ("-- name: a\nSELECT * FROM (\n  -- include: b\n) x", "unknown query 'b'"),
        (
            "-- name: a\nSELECT (\n-- include: b\n)\n-- name: b\nSELECT (\n-- include: a\n)",
            "includes itself",
        ),
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
