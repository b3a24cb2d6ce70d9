"""The keyword list's terms (search.sql: search_keyword_candidates $6 to $10): which of the
query's words choose its candidates, and what ranks them.

PostgreSQL reads the query's words under the tenant's text search configuration
(search.sql: keyword_terms); how common each word is comes from a sample of the tenant's
own chunks (tenant_common_lexemes, WordSample), never from other tenants' words, even those
sharing its partition. The counts are kept here a short while per tenant, so that a search
does not read them (which costs more than the rest of the terms) every time.

A word's commonness only decides which candidates are tried first and how cheaply; a stale
estimate costs time, never a chunk the principals may not read.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from services.search.kept import KeptFor


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
    """``common``: the estimated number of chunks holding each of the tenant's commonest
    lexemes; a lexeme not in it is rarer than those, and counts as rare (no chunks yet:
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


def sample_start(tenant_id: str) -> uuid.UUID:
    """Where a tenant's word sample begins in document-id order: fixed per tenant, so that
    its statistics, and so its queries' terms, change only with its chunks."""
    return uuid.UUID(bytes=hashlib.sha256(tenant_id.encode()).digest()[:16])


@dataclass(frozen=True)
class WordSample:
    """A run of a tenant's chunks in document-id order (search.sql: tenant_common_lexemes)
    and how many of them hold each of its commonest lexemes."""

    # How many chunks the sample asked for, and how many it read: fewer means all of them.
    limit: int
    sampled: int
    # How many chunks the tenant's search pointers serve (what the keyword list reads).
    served_chunks: int
    counts: Sequence[tuple[str, int]]

    def tenant_chunks(self) -> float:
        """The tenant's chunks: those the sample read when it read them all, otherwise
        those its pointers serve."""
        if self.sampled < self.limit:
            return float(self.sampled)
        return float(max(self.served_chunks, self.sampled))

    def common_lexemes(self) -> dict[str, float]:
        """Each sampled lexeme's estimated number of the tenant's chunks holding it."""
        if self.sampled == 0:
            return {}
        scale = self.tenant_chunks() / self.sampled
        return {lexeme: chunks * scale for lexeme, chunks in self.counts}


def word_sample(limit: int, rows: Sequence[Mapping[str, Any]]) -> WordSample:
    """tenant_common_lexemes' rows: the sample's size on each, and a lexeme on each unless
    no lexeme was seen twice (then one row without)."""
    if not rows:
        return WordSample(limit, 0, 0, ())
    first = rows[0]
    return WordSample(
        limit=limit,
        sampled=int(first["sampled"]),
        served_chunks=int(first["served_chunks"]),
        counts=tuple(
            (row["lexeme"], int(row["chunks"])) for row in rows if row["lexeme"] is not None
        ),
    )


class TenantStatistics:
    """Each tenant's common lexemes, read at most once per ``ttl_seconds`` (0: on every
    search), for at most ``entries`` tenants (the least recently searched are forgotten).
    A tenant without chunks yet is read again next time: its first chunks should count at
    once."""

    def __init__(
        self,
        ttl_seconds: float,
        entries: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._kept: KeptFor[str, Mapping[str, float]] = KeptFor(ttl_seconds, entries, clock)

    async def common(
        self, tenant_id: str, read: Callable[[], Awaitable[WordSample]]
    ) -> Mapping[str, float]:
        kept = self._kept.get(tenant_id)
        if kept is not None:
            return kept
        sample = await read()
        common = sample.common_lexemes()
        if sample.sampled:
            self._kept.put(tenant_id, common)
        else:
            self._kept.forget(tenant_id)
        return common
