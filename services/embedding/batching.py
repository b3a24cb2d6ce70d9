"""Cutting many texts into embedding requests, and putting the rows back together in order.

A request holds at most ``batch_size`` texts and, when a token budget is given, at most
``max_batch_tokens`` tokens (providers such as OpenAI and TEI limit both). A single text over
the budget still goes, alone: the provider truncates it or refuses it with its own error.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from services.embedding.port import Embedder, InputRefused, Vectors, checked_vectors
from services.embedding.tokens import TokenCounter, approximate_tokens


def plan_batches(
    texts: Sequence[str],
    *,
    batch_size: int,
    max_batch_tokens: int | None = None,
    count_tokens: TokenCounter | None = None,
) -> list[range]:
    """The requests as ranges of ``texts`` positions, in order, covering every text once."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if max_batch_tokens is not None and max_batch_tokens < 1:
        raise ValueError(f"max_batch_tokens must be >= 1, got {max_batch_tokens}")
    # Without the model's counter, the approximate one errs high: batches stay in budget.
    count = count_tokens or approximate_tokens
    batches: list[range] = []
    start = 0
    tokens = 0
    for position, text in enumerate(texts):
        size = position - start
        cost = count(text) if max_batch_tokens is not None else 0
        over_budget = max_batch_tokens is not None and tokens + cost > max_batch_tokens
        if size == batch_size or (size > 0 and over_budget):
            batches.append(range(start, position))
            start, tokens = position, 0
        tokens += cost
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
