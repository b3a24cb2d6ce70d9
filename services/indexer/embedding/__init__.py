"""Embedding: the provider port, its providers (local ONNX model, OpenAI-compatible HTTP,
hashing stand-in), their settings and factory, and batching of texts into requests."""

from services.indexer.embedding.batching import embed_batched, plan_batches
from services.indexer.embedding.hashing import HashingEmbedder
from services.indexer.embedding.port import Embedder, InputRefused, Vectors, checked_vectors

__all__ = [
    "Embedder",
    "HashingEmbedder",
    "InputRefused",
    "Vectors",
    "checked_vectors",
    "embed_batched",
    "plan_batches",
]
