"""The approximate-nearest-neighbour index of one embedding model, and how queries name it.

``knowledge_chunk.embedding`` has no fixed dimension (model and dimension are part of the
index identity), so each model gets its own partial expression index:

    CREATE INDEX <ann_index_name(model)> ON knowledge_chunk
        USING hnsw (<vector_expression(dimension)> vector_cosine_ops)
        WHERE <model_predicate(model)>

A query uses that index only when it orders by the very same expression and its WHERE
implies the very same predicate, written as a literal: with a bind parameter a generic plan
could not prove the partial predicate and would scan. Hence the SQL text is specialised
per model (and cached), from these three functions, never from user input.
"""

from __future__ import annotations

import hashlib
import re

_SAFE_MODEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,199}$")


def check_model_name(model: str) -> str:
    if not _SAFE_MODEL.match(model):
        raise ValueError(
            f"embedding model name {model!r} has characters outside [A-Za-z0-9._:/@+-]"
        )
    return model


def ann_index_name(model: str) -> str:
    return (
        "knowledge_chunk_ann_" + hashlib.sha256(check_model_name(model).encode()).hexdigest()[:16]
    )


def vector_expression(dimension: int, column: str = "embedding") -> str:
    if not 0 < dimension <= 16000:
        raise ValueError(f"embedding dimension {dimension} out of range")
    return f"({column}::vector({int(dimension)}))"


def model_predicate(model: str, column: str = "embedding_model") -> str:
    # check_model_name admits no quote, so the literal needs no escaping.
    return f"{column} = '{check_model_name(model)}'"


def create_ann_index_sql(model: str, dimension: int) -> str:
    """The DDL of the model's ANN index (HNSW, cosine distance), built without blocking
    writes. Run outside a transaction; ``PgVectorSink.ensure_generation`` decides when."""
    return (
        f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {ann_index_name(model)} ON knowledge_chunk"
        f" USING hnsw ({vector_expression(dimension)} vector_cosine_ops)"
        f" WHERE {model_predicate(model)}"
    )


def drop_ann_index_sql(model: str) -> str:
    """Drops the model's ANN index (an INVALID leftover of an interrupted build)."""
    return f"DROP INDEX CONCURRENTLY IF EXISTS {ann_index_name(model)}"
