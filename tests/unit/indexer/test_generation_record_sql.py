"""One statement writes what a generation holds of a document (issue 42): the completion's
record and `create`'s copy of the served pointers both go through
``upsert_document_generation_version`` (services/indexer/sink/generations.sql), so the rule
for the same version is written once (tests/integration/test_generation_record.py shows
which comparison each needs)."""

from __future__ import annotations

import re

from services.runtime.pg.sql import all_query_files, load_queries
from tests.support.stack import REPO_ROOT

_WRITE = re.compile(r"\bINSERT\s+INTO\s+document_generation_version\b", re.IGNORECASE)


def _without_comments(sql: str) -> str:
    return "\n".join(line.split("--", 1)[0] for line in sql.splitlines())


def test_one_statement_writes_a_generation_record() -> None:
    writers = [
        (str(path.relative_to(REPO_ROOT)), name)
        for path in all_query_files(REPO_ROOT / "services")
        for name, sql in load_queries(path).items()
        if _WRITE.search(_without_comments(sql))
    ]
    assert writers == [
        ("services/indexer/sink/generations.sql", "upsert_document_generation_version")
    ]
