"""Embedding: the provider port, its providers (local ONNX model, OpenAI-compatible HTTP,
hashing stand-in), their settings and factory, and batching of texts into requests."""

from services.embedding.batching import embed_batched, plan_batches
from services.embedding.hashing import HashingEmbedder
from services.embedding.port import Embedder, InputRefused, Vectors, checked_vectors

__all__ = [
    "Embedder",
    "HashingEmbedder",
    "InputRefused",
    "Vectors",
    "checked_vectors",
    "embed_batched",
    "plan_batches",
]
