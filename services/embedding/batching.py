"""Cutting many texts into embedding requests, and putting the rows back together in order.

A request holds at most ``batch_size`` texts and, when a token budget is given, at most
``max_batch_tokens`` tokens (providers such as OpenAI and TEI limit both). A single text over
the budget still goes, alone: the provider truncates it or refuses it with its own error.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from services.embedding.port import Embedder, InputRefused, Vectors, checked_vectors
from services.embedding.tokens import TokenCounter, approximate_tokens


@dataclass(frozen=True)
class Batching:
    """How a model's texts go out in requests (KB_EMBEDDING_* of its profile): at most
    ``batch_size`` texts and ``max_batch_tokens`` tokens a request, a partial request after
    ``linger_seconds``, at most ``max_requests_in_flight`` requests at once."""

    batch_size: int
    max_batch_tokens: int | None = None
    linger_seconds: float = 0.005
    max_requests_in_flight: int = 2


class RequestBudget:
    """What one request may still take: at most ``batch_size`` texts and, with a token
    budget, at most ``max_batch_tokens`` tokens -- except that an empty request takes any
    one text, however long. The one rule of ``plan_batches`` and of the shared queue
    (``coalescing.CoalescingEmbedder``)."""

    def __init__(self, batch_size: int, max_batch_tokens: int | None = None) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if max_batch_tokens is not None and max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {max_batch_tokens}")
        self.batch_size = batch_size
        self.max_batch_tokens = max_batch_tokens
        self.texts = 0
        self.tokens = 0

    def admits(self, cost: int) -> bool:
        if self.texts == 0:
            return True
        if self.texts >= self.batch_size:
            return False
        return self.max_batch_tokens is None or self.tokens + cost <= self.max_batch_tokens

    def add(self, cost: int) -> None:
        self.texts += 1
        self.tokens += cost


def plan_batches(
    texts: Sequence[str],
    *,
    batch_size: int,
    max_batch_tokens: int | None = None,
    count_tokens: TokenCounter | None = None,
) -> list[range]:
    """The requests as ranges of ``texts`` positions, in order, covering every text once."""
    budget = RequestBudget(batch_size, max_batch_tokens)
    # Without the model's counter, the approximate one errs high: batches stay in budget.
    count = count_tokens or approximate_tokens
    batches: list[range] = []
    start = 0
    for position, text in enumerate(texts):
        cost = count(text) if max_batch_tokens is not None else 0
        if not budget.admits(cost):
            batches.append(range(start, position))
            start, budget = position, RequestBudget(batch_size, max_batch_tokens)
        budget.add(cost)
    if start < len(texts):
        batches.append(range(start, len(texts)))
    return batches


async def embed_batched(
    embedder: Embedder,
    texts: Sequence[str],
    *,
    batch_size: int,
    max_batch_tokens: int | None = None,
    count_tokens: TokenCounter | None = None,
) -> Vectors:
    """Every text's vector, row i = texts[i]; one ``embedder.embed`` request per batch, one
        after another (a failed request fails the whole call with its own error; a refused input
    is named by its position in ``texts``)."""
    dimension = embedder.dimension
    out = np.empty((len(texts), dimension), dtype=np.float32)
    for batch in plan_batches(
        texts, batch_size=batch_size, max_batch_tokens=max_batch_tokens, count_tokens=count_tokens
    ):
        try:
            vectors = await embedder.embed([texts[i] for i in batch])
        except InputRefused as refused:
            raise refused.shifted(batch.start) from refused
        out[batch.start : batch.stop] = checked_vectors(
            vectors, rows=len(batch), dimension=dimension, source=embedder.model
        )
    return out
