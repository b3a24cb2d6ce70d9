"""Every candidate statement search can run, as services/search/statements.py assembles it
from statement_fragments.pgsql, against its snapshot in snapshots/ (one file per variant:
``<statement>.<vector path>.<kinds of keyword candidates>.sql``). A change to a fragment, to
which fragment a variant chooses, or to the assembly shows here as the whole statement's diff.

After a change you mean, rewrite the snapshots, then review and commit their diff:

    KB_UPDATE_SNAPSHOTS=1 uv run --frozen pytest tests/unit/search -q -p no:cacheprovider

Without it, a snapshot that is missing, stale, or of no variant fails the test.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

import pytest

from services.search.statements import (
    FRAGMENTS,
    KEYWORD_STATEMENT,
    STATEMENT_VARIANTS,
    VECTOR_STATEMENT,
    KeywordKinds,
    VectorPath,
    slot_choices,
    specialised_search_sql,
)

SNAPSHOTS = Path(__file__).parent / "snapshots"
UPDATE = os.environ.get("KB_UPDATE_SNAPSHOTS") == "1"
HOW_TO_UPDATE = (
    "if the change is meant, rewrite the snapshots with KB_UPDATE_SNAPSHOTS=1"
    " (tests/unit/search/test_statement_snapshots.py) and review their diff"
)
# The snapshots' model: its literals are all the model changes in a statement.
MODEL = "all-MiniLM-L6-v2-onnx-int8"
DIMENSION = 384


def variant_name(name: str, path: VectorPath, kinds: KeywordKinds) -> str:
    if name != KEYWORD_STATEMENT:
        return f"{name}.{path.value}"
    scanned = ["all_words"]
    scanned += ["any_word"] if kinds.any_word else []
    scanned += ["rarest_word"] if kinds.rarest_word else []
    return f"{name}.{path.value}.{'+'.join(scanned)}"


VARIANTS = {variant_name(*variant): variant for variant in STATEMENT_VARIANTS}


def test_there_is_a_variant_for_each_path_and_kinds() -> None:
    assert len(VARIANTS) == len(STATEMENT_VARIANTS) == 2 * (1 + 4)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_each_statement_is_its_snapshot(variant: str) -> None:
    sql = specialised_search_sql(MODEL, DIMENSION, *VARIANTS[variant]) + "\n"
    snapshot = SNAPSHOTS / f"{variant}.sql"
    if UPDATE:
        SNAPSHOTS.mkdir(exist_ok=True)
        if not snapshot.exists() or snapshot.read_text(encoding="utf-8") != sql:
            snapshot.write_text(sql, encoding="utf-8")
        return
    if not snapshot.exists():
        pytest.fail(f"{variant} has no snapshot {snapshot}: {HOW_TO_UPDATE}", pytrace=False)
    expected = snapshot.read_text(encoding="utf-8")
    if sql != expected:
        diff = "".join(
            difflib.unified_diff(
                expected.splitlines(keepends=True),
                sql.splitlines(keepends=True),
                f"{snapshot.name} (snapshot)",
                f"{snapshot.name} (assembled now)",
            )
        )
        pytest.fail(f"{snapshot} is stale: {HOW_TO_UPDATE}\n{diff}", pytrace=False)


def test_every_snapshot_is_of_a_variant() -> None:
    present = sorted(SNAPSHOTS.iterdir()) if SNAPSHOTS.is_dir() else []
    extra = [
        path
        for path in present
        if path.suffix != ".sql" or path.stem not in VARIANTS or not path.is_file()
    ]
    if UPDATE:
        for path in extra:
            path.unlink()
        return
    assert not extra, f"snapshots of no variant: {[p.name for p in extra]}: {HOW_TO_UPDATE}"


def test_every_fragment_is_part_of_a_statement() -> None:
    # Each fragment is a statement, included by another (runtime.pg.sql) or chosen for a slot.
    text = Path(FRAGMENTS.source).read_text(encoding="utf-8")
    included = {
        line.strip().removeprefix("-- include:").strip()
        for line in text.splitlines()
        if line.strip().startswith("-- include:")
    }
    chosen = {
        fragment
        for variant in STATEMENT_VARIANTS
        for fragment in slot_choices(*variant).values()
        if fragment is not None
    }
    assert set(FRAGMENTS) == {VECTOR_STATEMENT, KEYWORD_STATEMENT} | included | chosen


def test_only_the_two_statements_are_assembled() -> None:
    with pytest.raises(ValueError, match="no search statement named 'searchable_chunks'"):
        specialised_search_sql(MODEL, DIMENSION, "searchable_chunks")
