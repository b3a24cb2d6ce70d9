"""Search's SQL and settings: the statements run as written (``search.sql``), the two
candidate statements assembled per embedding model, vector path and kinds of keyword
candidates from named fragments (``statement_fragments.pgsql``), and what tunes them
(``KB_SEARCH_*``).

A candidate statement is its fragment with each ``-- slot: <slot>`` line replaced by what
the variant puts there: a fragment chosen from ``slot_choices`` (by path and kinds), the
model's literals (``_MODEL_SLOTS``), or nothing. Every text this assembles is kept in
tests/unit/search/snapshots/ (one file per variant), compared on every test run.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from functools import cache
from typing import Final

from pydantic import Field, field_validator

from services.index.ann import model_predicate, vector_expression
from services.runtime.pg.sql import indented, queries_beside
from services.runtime.settings import RuntimeSettings
from services.search.searcher import DEFAULT_QUERY_EMBED_TIMEOUT_SECONDS

QUERIES = queries_beside(__file__, "search.sql")
# Parts of statements, not statements: not a .sql file, whose named queries are each prepared
# on its own (tests/integration/test_migrations.py); the statements made of them are.
FRAGMENTS = queries_beside(__file__, "statement_fragments.pgsql")
_SLOT_LINE: Final = "-- slot:"

# The model and dimension search.sql was written for before its statements were assembled
# from fragments (bench.keyword_ab reads an old commit's search.sql with them).
TEMPLATE_MODEL: Final = "search-template-model"
TEMPLATE_DIMENSION: Final = 1


class VectorPath(Enum):
    """How the vector list finds the nearest readable chunks (statement_fragments.pgsql:
    vector_list_ann, vector_list_exact)."""

    # Walk an HNSW graph (the tenant's own, else its partition's), filters probed per
    # candidate, iterating.
    ANN = "ann"
    # Rank every chunk the principals may read: exact, and cheap while they are few.
    EXACT = "exact"


class SearchSettings(RuntimeSettings):
    # HNSW candidate list size: recall against latency. Each search uses at least its depth.
    # The default trades a longer graph walk for recall@10 against the exact answer, which
    # smaller lists lose on the large bench (BENCHMARKS.md). Only the ANN path uses it.
    search_ef_search: int = Field(default=600, ge=10, le=1000)
    # The same for a tenant with a graph of its own (KB_INDEXER_TENANT_GRAPH_MIN_CHUNKS):
    # its smaller graph reaches the same recall with a smaller list than the partition's.
    search_tenant_graph_ef_search: int = Field(default=200, ge=10, le=1000)
    # How many index tuples an iterative scan may visit before it gives up: bounds the cost
    # of a search whose principals may read only a sliver of the tenant.
    search_max_scan_tuples: int = Field(default=20_000, ge=1_000, le=10_000_000)
    # Principals who may read at most this many chunks of the tenant (current versions) get
    # them all ranked exactly (recall 1); more go through the tenant partition's HNSW index.
    # 0: always the index. Ranking exactly costs time in proportion to the chunks ranked (the
    # vector is in the row): the default is about as many as take the graph walk's time
    # (bench/search_latency.py, BENCHMARKS.md).
    search_exact_max_chunks: int = Field(default=5_000, ge=0, le=10_000_000)
    # How many chunks matching the query's words the keyword list ranks at most, of each
    # kind (all words; any of the rarer words): bounds a keyword search's cost whatever the
    # query, at the price of ranking only that many of the matches of very common words.
    # A search ranks at least its depth.
    search_keyword_candidates: int = Field(default=250, ge=10, le=100_000)
    # How long a principal set's vector path (exact or ANN, and whether the tenant has a
    # graph of its own) is reused before it is counted again (paths.py). The path
    # decides speed only: every path filters by version and ACL. 0: counted on every search.
    search_path_cache_seconds: float = Field(default=30.0, ge=0, le=3600)
    # How many principal sets' paths are kept, per process.
    search_path_cache_entries: int = Field(default=10_000, ge=1, le=1_000_000)
    # How long the keyword list keeps a tenant's word statistics (how many of its chunks
    # hold each of its commonest words, counted in a sample) before it reads them again
    # (keyword_terms). They steer which candidates are tried first, never which chunks are
    # eligible. 0: read on every keyword search.
    search_statistics_cache_seconds: float = Field(default=60.0, ge=0, le=3600)
    # How many tenants' word statistics are kept, per process.
    search_statistics_cache_entries: int = Field(default=10_000, ge=1, le=1_000_000)
    # How many of a tenant's chunks the word statistics count (all of a smaller tenant's).
    # More: finer estimates of the words of big tenants, for a longer read once per
    # search_statistics_cache_seconds.
    search_statistics_sample_chunks: int = Field(default=2_000, ge=100, le=1_000_000)
    # How many of the sample's commonest words are kept.
    search_statistics_lexemes: int = Field(default=1_000, ge=10, le=100_000)
    # How long a search waits for a connection before answering 503.
    search_acquire_timeout_seconds: float = Field(default=5.0, gt=0, le=60)
    # How long a search waits for its query's embedding: past it (or when the provider
    # throttles, is down or answers no embeddings), hybrid answers from the keyword list
    # alone, flagged "degraded": "keyword-only", and vector answers 503 with Retry-After.
    search_query_embed_timeout_seconds: float = Field(
        default=DEFAULT_QUERY_EMBED_TIMEOUT_SECONDS, gt=0, le=60
    )
    # Read replicas of DATABASE_URL that searches read (comma-separated postgresql:// URLs;
    # empty: the primary). Everything that writes stays on the primary (services/search/
    # replicas.py, docs/scaling.md#search-on-replicas).
    search_database_urls: str = ""
    # A replica whose replay lags the primary by more than this leaves the rotation until
    # it catches up; with none left, search reads the primary.
    search_replica_max_lag_seconds: float = Field(default=5.0, gt=0, le=3600)
    # How often each replica's lag is checked (the lag's resolution).
    search_replica_check_seconds: float = Field(default=1.0, gt=0, le=60)
    # How long a search with `after` tokens waits for a replica that has replayed them
    # before it reads the primary. 0: the primary at once when no replica has them yet.
    search_after_wait_seconds: float = Field(default=1.0, ge=0, le=60)

    @field_validator("search_database_urls")
    @classmethod
    def _replica_urls(cls, value: str) -> str:
        if any(not url.startswith(("postgresql://", "postgres://")) for url in _split(value)):
            raise ValueError("KB_SEARCH_DATABASE_URLS must list postgresql:// URLs")
        return value

    @property
    def search_replica_urls(self) -> tuple[str, ...]:
        return _split(self.search_database_urls)


def _split(urls: str) -> tuple[str, ...]:
    return tuple(url.strip() for url in urls.split(",") if url.strip())


# The planner settings vector_path_settings_sql changes (undo_vector_path restores them).
PLANNER_SETTINGS: Final = (
    "enable_sort",
    "enable_hashjoin",
    "enable_mergejoin",
    "enable_material",
    "enable_bitmapscan",
    "max_parallel_workers_per_gather",
    "plan_cache_mode",
)


def vector_path_settings_sql(path: VectorPath, ef_search: int, max_scan_tuples: int) -> str:
    """SET LOCAL statements for the vector list's path, run in its transaction before it
    (one round trip; integers and fixed words only).

    pgvector >= 0.8 iterative index scans: when the version and ACL probes reject most of
    what the HNSW scan yields, the scan goes on (up to ``max_scan_tuples``) instead of
    returning fewer than LIMIT rows; relaxed_order may hand rows back slightly out of
    distance order, and the statement ranks them by distance anyway.

    Custom plans: a generic plan would not see the tenant (to prune to its partition at
    planning) nor the LIMIT's value. Hash and merge joins off on both paths: the lists join
    a few hundred rows at most, by index, and the planner -- estimating the tenant's
    readable documents at a hundredth of what they are (it takes document ids to be
    independent of the tenant) -- would hash every search pointer of the tenant instead.
    On the ANN path sorting and materializing go off too: with sorting disabled the plan
    without a disabled node, the HNSW index's order, wins over sorting the tenant's chunks;
    the graph yields a few dozen candidates, and probing each one's pointer and ACL rows by
    index is cheap where collecting the readable documents first (and, estimated at a
    dozen, scanning them again per candidate) is slower for a principal who may read the
    whole tenant. On the exact path bitmap scans go off: the readable documents' pointers
    are read by one index scan of the documents listed from the ACL
    (statement_fragments.pgsql: searchable_chunks_listed) rather than every pointer of the
    tenant read from the heap. On both paths no parallel plans: a list reads a few thousand
    rows at most, where starting workers would cost more than they save; the planner never
    chose one for these lists, and no longer costs them out for every scan (the same plans
    for every principal set, planned in less time)."""
    if not (isinstance(ef_search, int) and isinstance(max_scan_tuples, int)):
        raise TypeError("ef_search and max_scan_tuples are integers")
    ann = path is VectorPath.ANN
    values = {
        "hnsw.iterative_scan": "relaxed_order",
        "hnsw.max_scan_tuples": str(max_scan_tuples),
        "hnsw.ef_search": str(ef_search),
        "enable_sort": "off" if ann else "on",
        "enable_hashjoin": "off",
        "enable_mergejoin": "off",
        "enable_material": "off" if ann else "on",
        "enable_bitmapscan": "on" if ann else "off",
        "max_parallel_workers_per_gather": "0",
        "plan_cache_mode": "force_custom_plan",
    }
    return "".join(f"SET LOCAL {name} = {value};" for name, value in values.items())


VECTOR_STATEMENT: Final = "search_vector_candidates"
KEYWORD_STATEMENT: Final = "search_keyword_candidates"


@dataclass(frozen=True)
class KeywordKinds:
    """Which of the keyword list's later kinds of candidates a query's terms can find
    (statement_fragments.pgsql: keyword_any_word_candidates needs a rarer word, $7;
    keyword_rarest_word_candidates a common one, $8); the first kind, chunks holding every
    word, is always there."""

    any_word: bool = True
    rarest_word: bool = True

    @classmethod
    def of(cls, any_word: str | None, rarest_word: str | None) -> KeywordKinds:
        return cls(any_word=any_word is not None, rarest_word=rarest_word is not None)


ALL_KEYWORD_KINDS: Final = KeywordKinds()
KEYWORD_KINDS: Final = tuple(
    KeywordKinds(any_word, rarest_word)
    for any_word in (True, False)
    for rarest_word in (True, False)
)


# Every variant of the two statements: (statement, vector path, kinds of keyword candidates).
STATEMENT_VARIANTS: Final = tuple(
    (name, path, kinds)
    for name in (VECTOR_STATEMENT, KEYWORD_STATEMENT)
    for path in VectorPath
    for kinds in (KEYWORD_KINDS if name == KEYWORD_STATEMENT else (ALL_KEYWORD_KINDS,))
)

# The slots of statement_fragments.pgsql a variant fills with one of its fragments, or
# leaves out (None): per statement and vector path ...
_PATH_CHOICES: Final[Mapping[tuple[str, VectorPath], Mapping[str, str | None]]] = {
    # Walk the model's HNSW graph, which probes each candidate anyway: no OFFSET 0 needed.
    (VECTOR_STATEMENT, VectorPath.ANN): {"vector_list": "vector_list_ann", "probe": None},
    # Rank every readable chunk from the exact list's index (searchable_chunks_listed).
    (VECTOR_STATEMENT, VectorPath.EXACT): {"vector_list": "vector_list_exact"},
    # Principals who may read most of the tenant: each candidate's version and ACL probed.
    (KEYWORD_STATEMENT, VectorPath.ANN): {"probe": "probe_each_candidate"},
    # Few readable chunks: the planner may start from the readable documents.
    (KEYWORD_STATEMENT, VectorPath.EXACT): {"probe": None},
}
# ... and, for the keyword list, per kind of candidates: (its scan, no scan).
_KIND_CHOICES: Final = {
    "keyword_any_word": ("keyword_any_word_candidates", "keyword_no_candidates"),
    "keyword_rarest_word": ("keyword_rarest_word_candidates", "keyword_no_candidates"),
}


def _dimension_predicate(dimension: int) -> str:
    vector_expression(dimension)  # checks the dimension is one
    return f"c.embedding_dimension = {int(dimension)}"


# The slots the model fills, with literals: a partial index (the model's HNSW index,
# services/index/ann.py; migrations/0017's exact list index) serves a statement only if the
# statement's text implies the index's predicate, and the HNSW index only an ORDER BY of its
# very expression. From services/index/ann.py's functions (which admit only safe model
# names), never from user input.
_MODEL_SLOTS: Final[Mapping[str, Callable[[str, int], str]]] = {
    "chunk_model": lambda model, _: "AND " + model_predicate(model, "c.embedding_model"),
    "pointer_model": lambda model, _: "AND " + model_predicate(model, "s.embedding_model"),
    "chunk_dimension": lambda _, dimension: "AND " + _dimension_predicate(dimension),
    "chunk_vector": lambda _, dimension: vector_expression(dimension, "c.embedding"),
}


def slot_choices(
    name: str, path: VectorPath = VectorPath.ANN, kinds: KeywordKinds = ALL_KEYWORD_KINDS
) -> dict[str, str | None]:
    """The fragment of statement_fragments.pgsql that fills each slot of statement ``name``
    on ``path`` (and, for the keyword list, with ``kinds`` of candidates); None: the slot is
    left out. The model's slots (``_MODEL_SLOTS``) aside."""
    if name not in (VECTOR_STATEMENT, KEYWORD_STATEMENT):
        raise ValueError(f"no search statement named {name!r}")
    if name != KEYWORD_STATEMENT and kinds != ALL_KEYWORD_KINDS:
        raise ValueError("only the keyword list has kinds of candidates")
    choices = dict(_PATH_CHOICES[(name, path)])
    if name == KEYWORD_STATEMENT:
        for slot, kind in (
            ("keyword_any_word", kinds.any_word),
            ("keyword_rarest_word", kinds.rarest_word),
        ):
            scan, no_scan = _KIND_CHOICES[slot]
            choices[slot] = scan if kind else no_scan
    return choices


@cache
def specialised_search_sql(
    model: str,
    dimension: int,
    name: str = VECTOR_STATEMENT,
    path: VectorPath = VectorPath.ANN,
    kinds: KeywordKinds = ALL_KEYWORD_KINDS,
) -> str:
    """Statement ``name`` as it runs for the model on ``path`` (and, for the keyword list,
    with ``kinds`` of candidates): its fragment of statement_fragments.pgsql, each slot
    filled with the fragment ``slot_choices`` says, or with the model's literals
    (``_MODEL_SLOTS``). One text per model and variant, so the server can cache its plan
    shape. The exact path ranks every readable chunk by the bare column, which no graph
    serves, from the leaves of a btree holding the vectors (vector_list_exact); on the ANN
    path the keyword list probes each candidate's version and ACL (probe_each_candidate). A
    keyword list whose query has no rarer word, or no common one, leaves out that kind's scan
    (keyword_no_candidates)."""
    choices = slot_choices(name, path, kinds)
    filled: set[str] = set()

    def piece(slot: str) -> str | None:
        filled.add(slot)
        if slot in _MODEL_SLOTS:
            return _MODEL_SLOTS[slot](model, dimension)
        if slot not in choices:
            raise AssertionError(f"{FRAGMENTS.source}: {name} has a slot {slot!r} it leaves open")
        fragment = choices[slot]
        if fragment is None:
            return None
        return f"-- slot {slot}: {fragment}\n" + _assembled(fragment, piece)

    sql = _assembled(name, piece)
    if unused := set(choices) - filled:
        raise AssertionError(f"{FRAGMENTS.source}: {name} has no slot {sorted(unused)}")
    return sql


def _assembled(fragment: str, piece: Callable[[str], str | None]) -> str:
    """Fragment ``fragment`` (its includes in place: runtime.pg.sql) with each of its slot lines
    replaced by ``piece(slot)``, indented as the line is; a slot without a piece is left out,
    line and all."""
    lines: list[str] = []
    for line in FRAGMENTS[fragment].splitlines():
        slot = _slot(line)
        if slot is None:
            lines.append(line)
        elif (text := piece(slot)) is not None:
            lines.append(indented(text, line[: len(line) - len(line.lstrip())]))
    return "\n".join(lines)


def _slot(line: str) -> str | None:
    """The slot a line of a fragment stands for (``-- slot: <slot>``, a line of its own)."""
    words = line.strip()
    if not words.startswith(_SLOT_LINE):
        return None
    slot = words.removeprefix(_SLOT_LINE).strip()
    if not (slot.isidentifier() and slot.islower()):
        raise ValueError(f"{FRAGMENTS.source}: {words!r} names no slot")
    return slot
