"""Which of a query's words choose the keyword list's candidates, how a tenant's word
statistics are estimated from a sample of its chunks, and how long they are kept."""

from __future__ import annotations

import pytest

from services.search.keyword_terms import (
    QueryWords,
    TenantStatistics,
    WordSample,
    keyword_terms,
    sample_start,
    word_sample,
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


def sample(
    sampled: int, *, limit: int = 100, served: int = 0, counts: tuple[tuple[str, int], ...] = ()
) -> WordSample:
    return WordSample(limit, sampled, served, counts)


def test_a_sample_that_read_every_chunk_counts_exactly() -> None:
    small = sample(40, served=35, counts=(("policy", 30), ("refund", 2)))
    assert small.tenant_chunks() == 40
    assert small.common_lexemes() == {"policy": 30.0, "refund": 2.0}


def test_a_full_sample_stands_for_every_chunk_the_tenant_serves() -> None:
    full = sample(100, served=400, counts=(("policy", 10),))
    assert full.tenant_chunks() == 400
    assert full.common_lexemes() == {"policy": 40.0}
    # Pointers behind the chunks (a version being switched): never fewer than were read.
    assert sample(100, served=60).tenant_chunks() == 100


def test_an_empty_sample_has_no_common_words() -> None:
    assert sample(0).common_lexemes() == {}
    assert sample(0).tenant_chunks() == 0


def test_word_sample_reads_the_rows() -> None:
    rows = [
        {"sampled": 7, "served_chunks": 9, "lexeme": "policy", "chunks": 4},
        {"sampled": 7, "served_chunks": 9, "lexeme": "refund", "chunks": 2},
    ]
    assert word_sample(100, rows) == WordSample(100, 7, 9, (("policy", 4), ("refund", 2)))
    lone = [{"sampled": 3, "served_chunks": 3, "lexeme": None, "chunks": None}]
    assert word_sample(100, lone).counts == ()
    assert word_sample(100, []).sampled == 0


def test_the_sample_starts_where_the_tenant_says() -> None:
    assert sample_start("acme") == sample_start("acme")
    assert sample_start("acme") != sample_start("globex")


class Reader:
    def __init__(self, *answers: WordSample) -> None:
        self.answers = list(answers)
        self.reads = 0

    async def __call__(self) -> WordSample:
        self.reads += 1
        return self.answers.pop(0)


def counted(**counts: int) -> WordSample:
    return sample(sum(counts.values()), counts=tuple(counts.items()))


async def test_statistics_are_read_once_per_ttl_per_tenant() -> None:
    now = [0.0]
    statistics = TenantStatistics(60, 10, clock=lambda: now[0])
    reader = Reader(counted(a=1), counted(a=2))
    assert await statistics.common("acme", reader) == {"a": 1.0}
    now[0] = 59.9
    assert await statistics.common("acme", reader) == {"a": 1.0}
    assert reader.reads == 1
    other = Reader(counted(b=1))
    assert await statistics.common("globex", other) == {"b": 1.0}
    now[0] = 60.0
    assert await statistics.common("acme", reader) == {"a": 2.0}
    assert reader.reads == 2


async def test_a_tenant_without_chunks_is_read_again() -> None:
    statistics = TenantStatistics(60, 10, clock=lambda: 0.0)
    reader = Reader(sample(0), counted(a=1), counted(a=9))
    assert await statistics.common("acme", reader) == {}
    assert await statistics.common("acme", reader) == {"a": 1.0}  # its first chunks count
    assert await statistics.common("acme", reader) == {"a": 1.0}
    assert reader.reads == 2


async def test_a_tenant_without_common_words_is_kept_too() -> None:
    statistics = TenantStatistics(60, 10, clock=lambda: 0.0)
    reader = Reader(sample(3), sample(3))
    assert await statistics.common("acme", reader) == {}
    assert await statistics.common("acme", reader) == {}
    assert reader.reads == 1


async def test_the_least_recently_searched_tenant_is_forgotten() -> None:
    statistics = TenantStatistics(60, 2, clock=lambda: 0.0)
    readers = {t: Reader(counted(a=1), counted(a=2)) for t in ("t1", "t2", "t3")}
    await statistics.common("t1", readers["t1"])
    await statistics.common("t2", readers["t2"])
    await statistics.common("t1", readers["t1"])  # t2 is now the least recent
    await statistics.common("t3", readers["t3"])
    assert await statistics.common("t1", readers["t1"]) == {"a": 1.0}
    assert await statistics.common("t2", readers["t2"]) == {"a": 2.0}  # read again
    assert (readers["t1"].reads, readers["t2"].reads) == (1, 2)


async def test_ttl_zero_reads_every_time() -> None:
    statistics = TenantStatistics(0, 10, clock=lambda: 0.0)
    reader = Reader(counted(a=1), counted(a=2))
    assert await statistics.common("acme", reader) == {"a": 1.0}
    assert await statistics.common("acme", reader) == {"a": 2.0}
    with pytest.raises(ValueError, match="ttl_seconds"):
        TenantStatistics(-1, 10)
    with pytest.raises(ValueError, match="entries"):
        TenantStatistics(60, 0)
