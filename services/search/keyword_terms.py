"""The keyword list's terms (search.sql: search_keyword_candidates $6 to $10): which of the
query's words choose its candidates, and what ranks them.

PostgreSQL reads the query's words under the tenant's text search configuration
(search.sql: keyword_terms); how common each word is comes from the statistics ANALYZE
keeps on the tenant's partition (partition_common_lexemes), which change only when ANALYZE
runs again: they are kept here a short while per partition, so that a search does not read
them (which costs more than the rest of the terms) every time.

A word's commonness only decides which candidates are tried first and how cheaply; a stale
estimate costs time, never a chunk the principals may not read.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class QueryWords:
    """The query as PostgreSQL reads it (search.sql: keyword_terms)."""

    # websearch_to_tsquery's reading (every word; "a phrase", -not, or); None: no lexeme.
    strict: str | None
    # No quotes, no leading minus, no lone "or": a natural question, whose rarer words may
    # each bring candidates.
    natural: bool
    # The query's lexemes (stop words dropped, words stemmed), in the database's order.
    lexemes: tuple[str, ...]
    # Each lexeme as a tsquery of that lexeme alone, in the same order.
    queries: tuple[str, ...]

    def __post_init__(self) -> None:
        if len(self.lexemes) != len(self.queries):
            raise ValueError("a query's words need one tsquery per lexeme")


@dataclass(frozen=True)
class KeywordTerms:
    strict: str | None
    # For a natural question, the OR of its lexemes estimated in at most `cap` chunks (a
    # common word like "how" or "policy" would bring candidates from most of the table,
    # crowding out the telling ones).
    any_word: str | None
    # For a natural question, the rarest of its other lexemes, if any (ties: the first).
    rarest_word: str | None
    # The OR of all its lexemes: what ts_rank weighs a chunk's occurrences against.
    ranking: str | None
    lexemes: tuple[str, ...]

    def parameters(self) -> tuple[Any, ...]:
        """search_keyword_candidates' $6 to $10."""
        return (self.strict, self.any_word, self.rarest_word, self.ranking, list(self.lexemes))


def keyword_terms(words: QueryWords, common: Mapping[str, float], cap: int) -> KeywordTerms:
    """``common``: the estimated number of chunks holding each of the partition's commonest
    lexemes; a lexeme not in it is rarer than those, and counts as rare (no statistics yet:
    every lexeme does)."""
    estimated = [common.get(lexeme, 0.0) for lexeme in words.lexemes]
    rare = [query for query, chunks in zip(words.queries, estimated, strict=True) if chunks <= cap]
    others = [(chunks, n) for n, chunks in enumerate(estimated) if chunks > cap]
    return KeywordTerms(
        strict=words.strict,
        any_word=(" | ".join(rare) or None) if words.natural else None,
        rarest_word=words.queries[min(others)[1]] if others and words.natural else None,
        ranking=" | ".join(words.queries) or None,
        lexemes=words.lexemes,
    )


def common_lexemes(rows: Sequence[tuple[str, float]]) -> dict[str, float]:
    return {lexeme: float(chunks) for lexeme, chunks in rows}


class PartitionStatistics:
    """Each partition's common lexemes, read at most once per ``ttl_seconds`` (0: on every
    search). A partition without statistics yet is read again next time: its first ANALYZE
    should count at once. Bounded by the number of partitions (migrations/0014)."""

    def __init__(
        self,
        ttl_seconds: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl_seconds < 0:
            raise ValueError("partition statistics need ttl_seconds >= 0")
        self._ttl = ttl_seconds
        self._clock = clock
        self._kept: dict[str, tuple[float, Mapping[str, float]]] = {}

    async def common(
        self, partition: str, read: Callable[[], Awaitable[Mapping[str, float]]]
    ) -> Mapping[str, float]:
        kept = self._kept.get(partition)
        now = self._clock()
        if kept is not None and now < kept[0]:
            return kept[1]
        common = await read()
        if common and self._ttl > 0:
            self._kept[partition] = (now + self._ttl, common)
        else:
            self._kept.pop(partition, None)
        return common
