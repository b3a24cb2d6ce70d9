"""One form for a principal, in publish and in search (services.runtime.tenancy.principals)."""

from __future__ import annotations

import pytest

from services.embedding import HashingEmbedder, Vectors
from services.publisher.domain import check_principals
from services.runtime.tenancy.principals import normalise_principal, normalise_principals
from services.search.searcher import Candidates, Generation, Searcher, SearchRequest
from tests.unit.indexer.test_search import FakeIndex


@pytest.mark.parametrize(
    ("given", "stored"),
    [
        ("group:support", "group:support"),
        ("  group:support ", "group:support"),
        ("group:cafe\u0301", "group:caf\u00e9"),  # a combining accent composes
        ("Group:Support", "Group:Support"),  # case is the principal's own
    ],
)
def test_search_and_publish_write_a_principal_alike(given: str, stored: str) -> None:
    assert normalise_principal(given) == stored
    assert check_principals([given]) == frozenset({stored})


def test_a_requests_principals_are_normalised_once_each_in_order() -> None:
    assert normalise_principals(["b", " a", "a ", "  ", "cafe\u0301", "caf\u00e9"]) == (
        "b",
        "a",
        "caf\u00e9",
    )
    assert normalise_principals([]) == ()


async def test_the_searcher_asks_the_index_with_normalised_principals() -> None:
    seen: list[tuple[str, ...]] = []

    class RecordingIndex(FakeIndex):
        async def candidates(
            self, request: SearchRequest, query_vector: Vectors | None
        ) -> Candidates:
            seen.append(request.principals)
            return await super().candidates(request, query_vector)

    embedder = HashingEmbedder(8)
    searcher = Searcher(embedder, RecordingIndex(Generation(embedder.model, 8)))
    request = SearchRequest("acme", "refund", (" group:cafe\u0301 ", "group:caf\u00e9"))
    await searcher.search(request)
    assert seen == [("group:caf\u00e9",)]
