"""Which of a query's words choose the keyword list's candidates, and how long a partition's
word statistics are kept."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from services.search.keyword_terms import (
    PartitionStatistics,
    QueryWords,
    common_lexemes,
    keyword_terms,
)

CAP = 100


def words(*lexemes: str, natural: bool = True, strict: str | None = "x") -> QueryWords:
    return QueryWords(strict, natural, lexemes, tuple(f"'{lexeme}'" for lexeme in lexemes))


def test_rare_words_bring_candidates_and_the_rarest_common_one_fills() -> None:
    common = {"polici": 5_000.0, "how": 9_000.0, "refund": float(CAP)}
    terms = keyword_terms(words("how", "polici", "refund", "zebra"), common, CAP)
    assert terms.any_word == "'refund' | 'zebra'"  # at most CAP chunks counts as rare
    assert terms.rarest_word == "'polici'"
    assert terms.ranking == "'how' | 'polici' | 'refund' | 'zebra'"
    assert terms.strict == "x"
    assert terms.parameters() == (
        "x",
        "'refund' | 'zebra'",
        "'polici'",
        "'how' | 'polici' | 'refund' | 'zebra'",
        ["how", "polici", "refund", "zebra"],
    )


def test_equally_common_words_leave_the_first_in_the_databases_order() -> None:
    common = {"b": 500.0, "a": 500.0, "c": 200.0}
    assert keyword_terms(words("a", "b", "c"), common, CAP).rarest_word == "'c'"
    assert keyword_terms(words("a", "b"), common, CAP).rarest_word == "'a'"


def test_the_users_syntax_keeps_only_the_strict_reading() -> None:
    terms = keyword_terms(words("polici", "refund", natural=False), {"polici": 1e6}, CAP)
    assert terms.any_word is None
    assert terms.rarest_word is None
    assert terms.ranking == "'polici' | 'refund'"


def test_only_common_words_or_none_at_all() -> None:
    common = {"how": 9_000.0}
    only_common = keyword_terms(words("how"), common, CAP)
    assert only_common.any_word is None
    assert only_common.rarest_word == "'how'"
    nothing = keyword_terms(words(strict=None), common, CAP)
    assert (nothing.strict, nothing.any_word, nothing.rarest_word, nothing.ranking) == (
        None,
        None,
        None,
        None,
    )
    assert nothing.lexemes == ()


def test_without_statistics_every_word_is_rare() -> None:
    terms = keyword_terms(words("how", "polici"), {}, CAP)
    assert terms.any_word == "'how' | 'polici'"
    assert terms.rarest_word is None


def test_a_query_needs_one_tsquery_per_lexeme() -> None:
    with pytest.raises(ValueError, match="one tsquery per lexeme"):
        QueryWords("x", True, ("a", "b"), ("'a'",))


def test_common_lexemes_reads_rows() -> None:
    assert common_lexemes([("polici", 12.5), ("how", 3)]) == {"polici": 12.5, "how": 3.0}


class Reader:
    def __init__(self, *answers: Mapping[str, float]) -> None:
        self.answers = list(answers)
        self.reads = 0

    async def __call__(self) -> Mapping[str, float]:
        self.reads += 1
        return self.answers.pop(0)


async def test_statistics_are_read_once_per_ttl_per_partition() -> None:
    now = [0.0]
    statistics = PartitionStatistics(60, clock=lambda: now[0])
    first, second = {"a": 1.0}, {"a": 2.0}
    reader = Reader(first, second)
    assert await statistics.common("p1", reader) == first
    now[0] = 59.9
    assert await statistics.common("p1", reader) == first
    assert reader.reads == 1
    other = Reader({"b": 1.0})
    assert await statistics.common("p2", other) == {"b": 1.0}
    now[0] = 60.0
    assert await statistics.common("p1", reader) == second
    assert reader.reads == 2


async def test_a_partition_without_statistics_is_read_again() -> None:
    statistics = PartitionStatistics(60, clock=lambda: 0.0)
    reader = Reader({}, {"a": 1.0}, {"a": 9.0})
    assert await statistics.common("p1", reader) == {}
    assert await statistics.common("p1", reader) == {"a": 1.0}  # its first ANALYZE counts
    assert await statistics.common("p1", reader) == {"a": 1.0}
    assert reader.reads == 2


async def test_ttl_zero_reads_every_time() -> None:
    statistics = PartitionStatistics(0, clock=lambda: 0.0)
    reader = Reader({"a": 1.0}, {"a": 2.0})
    assert await statistics.common("p1", reader) == {"a": 1.0}
    assert await statistics.common("p1", reader) == {"a": 2.0}
    with pytest.raises(ValueError, match="ttl_seconds"):
        PartitionStatistics(-1)
