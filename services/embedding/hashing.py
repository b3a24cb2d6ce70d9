"""A deterministic stand-in embedder by feature hashing, for plumbing tests and chaos runs.

Not a semantic model and never the default: texts that share words get similar vectors,
which is enough to prove that chunks, vectors and search results travel to the right places.
Each lower-cased word is hashed into one of ``dimension`` buckets with a hashed sign; the
counts are L2-normalised. The same text gives the same vector in every process and run.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections.abc import Sequence

import numpy as np

from services.embedding.port import FixedIdentity, Vectors
from services.embedding.tokens import TokenizerSpec

_WORD = re.compile(r"\w+")
# A text without words still needs a unit vector: a zero vector has no cosine distance.
_NO_WORDS = "\x00no-words"


class HashingEmbedder(FixedIdentity):
    def __init__(self, dimension: int = 384) -> None:
        if not 1 <= dimension <= 16000:
            raise ValueError(f"hashing embedder dimension {dimension} out of range 1..16000")
        # Approximate token counting: the hashing embedder has no tokenizer of its own and
        # reads every word, so a generous input limit.
        tokenizer = TokenizerSpec(name="approximate", tokenizer_file=None, max_input_tokens=8192)
        super().__init__(f"hashing-v1-{dimension}", dimension, tokenizer)

    def embed_sync(self, texts: Sequence[str]) -> Vectors:
        vectors = np.zeros((len(texts), self._dimension), dtype=np.float32)
        for row, text in enumerate(texts):
            words = _WORD.findall(text.lower()) or [_NO_WORDS]
            for word in words:
                digest = int.from_bytes(hashlib.blake2b(word.encode(), digest_size=8).digest())
                sign = 1.0 if digest >> 63 else -1.0
                vectors[row, digest % self._dimension] += sign
            norm = float(np.linalg.norm(vectors[row]))
            if norm == 0.0:
                # Signs cancelled out exactly ("a b" with opposite signs in one bucket).
                vectors[row, 0] = 1.0
            else:
                vectors[row] /= norm
        return vectors

    async def embed(self, texts: Sequence[str]) -> Vectors:
        # Microseconds per chunk, but a huge document's batches add up: off the loop, so
        # heartbeats keep their beat.
        return await asyncio.to_thread(self.embed_sync, list(texts))

    async def aclose(self) -> None:
        return None
