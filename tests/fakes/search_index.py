"""A search index that answers fixed candidate lists, whatever the request: for tests of the
searcher and the composed app without a database."""

from __future__ import annotations

import uuid

from services.embedding.port import Vectors
from services.search.searcher import Candidate, Candidates, Generation, SearchRequest

DOC = uuid.UUID("00000000-0000-0000-0000-00000000000d")
DIMENSION = 8


def candidate(chunk: str, rank: int, score: float, coverage: float | None = None) -> Candidate:
    return Candidate(
        DOC,
        "Title",
        1,
        chunk,
        ("H",),
        f"text {chunk}",
        rank,
        score,
        coverage,
        media_type="text/plain",
    )


class FakeIndex:
    """Both lists, whatever the request: the vector list only when given a vector."""

    def __init__(self) -> None:
        self.generation = Generation(f"hashing-v1-{DIMENSION}", DIMENSION)
        self.requests: list[SearchRequest] = []
        self.vectors: list[Vectors | None] = []

    async def candidates(self, request: SearchRequest, query_vector: Vectors | None) -> Candidates:
        self.requests.append(request)
        self.vectors.append(query_vector)
        # A weak keyword hit (low coverage) that hybrid fusion would leave out: keyword-only
        # answers rank it as keyword mode does.
        keyword = [candidate("k1", 1, 3.0, 1.0), candidate("k2", 2, 1.0, 0.1)]
        vector = [candidate("v", 1, 0.9)] if query_vector is not None else []
        return Candidates(vector=vector, keyword=keyword)
