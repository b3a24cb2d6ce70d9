from __future__ import annotations

from pathlib import Path

import pytest

from services.runtime.pg import sql
from services.runtime.pg.sql import load_queries, parse_queries


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


def test_an_include_from_another_file_takes_that_files_query() -> None:
    other = {"shared_part": "SELECT x\n  FROM t"}
    text = """
-- name: whole
SELECT count(*)
  FROM (
        -- include: shared_part from services/runtime/other.sql
       ) AS part
"""
    queries = parse_queries(text, other_file={"services/runtime/other.sql": other}.__getitem__)
    assert queries["whole"] == (
        "SELECT count(*)\n  FROM (\n        SELECT x\n          FROM t\n       ) AS part"
    )
    with pytest.raises(ValueError, match=r"unknown query 'nope' of services/runtime/other\.sql"):
        parse_queries(
            "-- name: a\nSELECT * FROM (\n-- include: nope from services/runtime/other.sql\n) x",
            other_file={"services/runtime/other.sql": other}.__getitem__,
        )
    with pytest.raises(ValueError, match="includes a query of"):
        parse_queries(text)


def test_query_files_are_found_from_the_services_root_and_may_not_include_each_other(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sql, "_ROOT", tmp_path)
    (tmp_path / "shared.sql").write_text("-- name: part\nSELECT 1 AS one\n")
    (tmp_path / "user.sql").write_text(
        "-- name: whole\nSELECT * FROM (\n    -- include: part from shared.sql\n) AS p\n"
    )
    assert load_queries(tmp_path / "user.sql")["whole"] == (
        "SELECT * FROM (\n    SELECT 1 AS one\n) AS p"
    )
    (tmp_path / "a.sql").write_text("-- name: a\nSELECT * FROM (\n-- include: b from b.sql\n) x\n")
    (tmp_path / "b.sql").write_text("-- name: b\nSELECT * FROM (\n-- include: a from a.sql\n) x\n")
    with pytest.raises(ValueError, match="include each other"):
        load_queries(tmp_path / "a.sql")


def test_the_operator_and_index_check_count_the_chunks_search_version_serves() -> None:
    # One text for "the chunks of a document's current search version", the chunking
    # strategy included (services/runtime/indexing/search_version.sql).
    shared = load_queries(sql._ROOT / "services/runtime/indexing/search_version.sql")
    fragment = shared["current_version_chunks"]
    assert "c.chunking_strategy = s.chunking_strategy" in fragment
    operator = load_queries(sql._ROOT / "services/operator/queries.sql")
    index_check = load_queries(sql._ROOT / "services/indexer/maintenance/index_check.sql")
    for query in (
        operator["document_chunks"],
        operator["count_document_chunks"],
        index_check["document_index_states"],
    ):
        assert "c.chunking_strategy = s.chunking_strategy" in query
        assert "-- include:" not in query


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
