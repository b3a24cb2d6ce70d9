"""The embedding port: what every embedding provider offers the pipeline.

A provider embeds one request (one batch) at a time; ``batching.embed_batched`` cuts a
document's chunks into requests. Model and dimension are part of the index identity (an
index generation), so a provider names both and never changes them while it runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from services.embedding.tokens import TokenizerSpec
from services.runtime.indexing.index_failures import ErrorCode, IndexingFailed

Vectors = npt.NDArray[np.float32]


@runtime_checkable
class Embedder(Protocol):
    @property
    def model(self) -> str:
        """The model name stored with every vector (checked by index.ann.check_model_name)."""
        ...

    @property
    def dimension(self) -> int: ...

    @property
    def tokenizer(self) -> TokenizerSpec:
        """How the model counts tokens, and the most it reads of one input (for chunking)."""
        ...

    async def embed(self, texts: Sequence[str]) -> Vectors:
        """ONE request: float32 array of shape ``(len(texts), dimension)``, row i = texts[i].

        Raises ``IndexingFailed`` with EMBEDDING_RATE_LIMITED (with ``retry_after_seconds``),
        EMBEDDING_TIMEOUT, EMBEDDING_UNAVAILABLE, EMBEDDING_RESPONSE_INVALID or
        EMBEDDING_MODEL_CHANGED. CPU-bound local inference runs off the event loop."""
        ...

    async def aclose(self) -> None: ...


class FixedIdentity:
    """The ``Embedder``'s model, dimension and tokenizer for a provider that knows them
    when it is made: fixed for its life, as the index generation needs them to be."""

    def __init__(self, model: str, dimension: int, tokenizer: TokenizerSpec) -> None:
        self._model = model
        self._dimension = dimension
        self._tokenizer = tokenizer

    @property
    def model(self) -> str:
        return self._model

    @property
    def dimension(self) -> int:
        return self._dimension

    @property
    def tokenizer(self) -> TokenizerSpec:
        return self._tokenizer


class PassedThroughIdentity:
    """The ``Embedder``'s model, dimension and tokenizer of a wrapper around ``inner`` (a
    request queue, a guard, a test's recorder): they are the wrapped provider's."""

    inner: Embedder

    @property
    def model(self) -> str:
        return self.inner.model

    @property
    def dimension(self) -> int:
        return self.inner.dimension

    @property
    def tokenizer(self) -> TokenizerSpec:
        return self.inner.tokenizer


class InputRefused(IndexingFailed):
    """The provider refused one input on its own (typically longer than the model accepts).

    Terminal (EMBEDDING_RESPONSE_INVALID): the same input would be refused again. ``position``
    is the input's place in the texts of the call that raised it."""

    # The class's own name for it; instances carry EMBEDDING_RESPONSE_INVALID, the policy's.
    code = "EMBEDDING_INPUT_REFUSED"

    def __init__(self, position: int, detail: str) -> None:
        super().__init__(
            ErrorCode.EMBEDDING_RESPONSE_INVALID,
            f"the embedding provider refused input {position} on its own: {detail}",
        )
        self.position = position
        self.detail = detail

    def shifted(self, offset: int) -> InputRefused:
        """The same refusal, positioned in a longer sequence that starts ``offset`` earlier."""
        return InputRefused(self.position + offset, self.detail)


# Below this L2 norm a vector counts as zero. Real embeddings are unit vectors or close to
# it; this only has to be far above float rounding noise around an all-zero answer.
MIN_VECTOR_NORM: Final = 1e-6


def checked_vectors(vectors: Vectors, *, rows: int, dimension: int, source: str) -> Vectors:
    """``vectors`` if it has the promised shape, only finite values and no zero-norm row, else
    EMBEDDING_RESPONSE_INVALID: a vector that is wrong in shape or NaN must never reach the
    index, where it would corrupt every search that touches it."""
    if vectors.ndim != 2 or vectors.shape != (rows, dimension):
        raise IndexingFailed(
            ErrorCode.EMBEDDING_RESPONSE_INVALID,
            f"{source} returned vectors of shape {vectors.shape}, expected ({rows}, {dimension})",
        )
    if not np.isfinite(vectors).all():
        bad = int(np.argwhere(~np.isfinite(vectors))[0][0])
        raise IndexingFailed(
            ErrorCode.EMBEDDING_RESPONSE_INVALID,
            f"{source} returned a non-finite value in the vector of input {bad}",
        )
    # A zero vector has no direction: its cosine distance to anything is 0/0, a NaN score
    # that poisons the exact ranking of every search reaching it. Norms in float64, so that
    # a tiny but genuine float32 vector is not squared into an underflow.
    norms = np.linalg.norm(vectors.astype(np.float64, copy=False), axis=1)
    if bool((norms < MIN_VECTOR_NORM).any()):
        bad = int(np.argmax(norms < MIN_VECTOR_NORM))
        raise IndexingFailed(
            ErrorCode.EMBEDDING_RESPONSE_INVALID,
            f"{source} returned a zero-norm vector for input {bad}",
        )
    return vectors.astype(np.float32, copy=False)
