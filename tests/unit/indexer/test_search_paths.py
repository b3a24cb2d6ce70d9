"""The vector path's cache and its transaction settings (pure)."""

from __future__ import annotations

import uuid

import pytest

from services.search.paths import PathCache, PathChoice, path_key
from services.search.searcher import SearchFilter, SearchMode, SearchRequest
from services.search.statements import (
    PLANNER_SETTINGS,
    VectorPath,
    vector_path_settings_sql,
)

ANN = PathChoice(VectorPath.ANN, tenant_graph=True, broad=True)
EXACT = PathChoice(VectorPath.EXACT, tenant_graph=False, broad=False)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def request(principals: tuple[str, ...], **filters: object) -> SearchRequest:
    return SearchRequest(
        "acme",
        "q",
        principals,
        10,
        SearchMode.VECTOR,
        SearchFilter(**filters),  # type: ignore[arg-type]
    )


def test_the_keyword_list_follows_how_much_the_principals_read_not_the_graph() -> None:
    graphless_broad = PathChoice(VectorPath.EXACT, tenant_graph=False, broad=True)
    assert graphless_broad.keyword_path is VectorPath.ANN
    assert ANN.keyword_path is VectorPath.ANN
    assert EXACT.keyword_path is VectorPath.EXACT


def test_a_choice_is_kept_until_its_time_is_up() -> None:
    clock = Clock()
    cache = PathCache(30, 10, clock)
    key = path_key(request(("group:a",)))
    cache.put(key, ANN)
    clock.now += 29.9
    assert cache.get(key) == ANN
    clock.now += 0.1
    assert cache.get(key) is None
    assert len(cache) == 0


def test_zero_seconds_keeps_nothing() -> None:
    cache = PathCache(0, 10)
    key = path_key(request(("group:a",)))
    cache.put(key, ANN)
    assert cache.get(key) is None


def test_the_least_recently_used_choice_goes_first() -> None:
    cache = PathCache(30, 2, Clock())
    a, b, c = (path_key(request((f"group:{n}",))) for n in "abc")
    cache.put(a, ANN)
    cache.put(b, EXACT)
    assert cache.get(a) == ANN  # a is now the most recent
    cache.put(c, EXACT)
    assert cache.get(b) is None
    assert cache.get(a) == ANN
    assert cache.get(c) == EXACT


def test_the_key_is_the_tenant_the_principal_set_and_the_document_filter() -> None:
    one, two = uuid.uuid4(), uuid.uuid4()
    assert path_key(request(("b", "a", "a"))) == path_key(request(("a", "b")))
    assert path_key(request(("a",))) != path_key(request(("A",)))  # principals keep case
    assert path_key(request(("a",))) != path_key(request(("a",), document_ids=(one,)))
    assert path_key(request(("a",), document_ids=(one, two))) == path_key(
        request(("a",), document_ids=(two, one))
    )
    # The heading filter does not change what the principals may read in all.
    assert path_key(request(("a",))) == path_key(request(("a",), heading_prefix=("Refunds",)))
    other_tenant = SearchRequest("globex", "q", ("a",), 10, SearchMode.VECTOR)
    assert path_key(other_tenant) != path_key(request(("a",)))


def test_a_cache_refuses_negative_seconds_or_no_room() -> None:
    with pytest.raises(ValueError, match="ttl_seconds >= 0"):
        PathCache(-1, 10)
    with pytest.raises(ValueError, match="max_entries >= 1"):
        PathCache(30, 0)


def settings_of(sql: str) -> dict[str, str]:
    pairs = [s.removeprefix("SET LOCAL ").split(" = ") for s in sql.split(";") if s]
    return {name: value for name, value in pairs}


def test_the_ann_path_walks_the_graph_and_probes_each_candidate() -> None:
    values = settings_of(vector_path_settings_sql(VectorPath.ANN, 200, 20_000))
    assert values["hnsw.ef_search"] == "200"
    assert values["hnsw.max_scan_tuples"] == "20000"
    assert values["hnsw.iterative_scan"] == "relaxed_order"
    for off in ("enable_sort", "enable_hashjoin", "enable_mergejoin", "enable_material"):
        assert values[off] == "off"
    assert values["enable_bitmapscan"] == "on"
    assert values["plan_cache_mode"] == "force_custom_plan"
    assert values["max_parallel_workers_per_gather"] == "0"


def test_the_exact_path_sorts_and_probes_from_the_acl() -> None:
    values = settings_of(vector_path_settings_sql(VectorPath.EXACT, 600, 20_000))
    assert values["enable_sort"] == "on"
    assert values["enable_bitmapscan"] == "off"
    assert values["enable_hashjoin"] == "off"
    # What undo_vector_path restores is every planner setting a path changes.
    assert {n for n in values if not n.startswith("hnsw.")} == set(PLANNER_SETTINGS)


def test_only_integers_go_into_the_settings_text() -> None:
    with pytest.raises(TypeError):
        vector_path_settings_sql(VectorPath.ANN, "200; DROP TABLE tenant", 20_000)  # type: ignore[arg-type]
