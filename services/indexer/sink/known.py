"""Embeddings the index already holds, found by content digest: unchanged content of a new
version (or another document's identical paragraph) is not embedded again.

The slots of one process ask at once as their documents are chunked; the questions that
arrive while one query is out share the next one, a query per tenant and generation
(services/runtime/pg/coalesce.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import asyncpg
import numpy as np
import numpy.typing as npt

from services.index.generation import IndexGeneration
from services.runtime.pg.coalesce import Coalesced
from services.runtime.pg.db import translate_db_errors
from services.runtime.pg.sql import queries_beside

QUERIES = queries_beside(__file__, "sink.sql")

# One content digest asked of the index: tenant, model, strategy, dimension, digest.
KnownDigest = tuple[str, str, str, int, bytes]
Vector = npt.NDArray[np.float32]


class KnownEmbeddings:
    def __init__(self, pool: asyncpg.Pool[Any]) -> None:
        self._pool = pool
        self._asked: Coalesced[KnownDigest, Vector] = Coalesced(self._read)

    async def embeddings(
        self, tenant_id: str, generation: IndexGeneration, digests: Sequence[bytes]
    ) -> dict[bytes, Vector]:
        """The tenant's embeddings of these digests under ``generation`` (sink.sql:
        known_embeddings); a digest not found is left out."""
        key = (tenant_id, generation.embedding_model, generation.chunking_strategy)
        found = await self._asked.get_many(
            (*key, generation.dimension, digest) for digest in digests
        )
        return {asked[-1]: vector for asked, vector in found.items()}

    async def _read(self, asked: Sequence[KnownDigest]) -> Mapping[KnownDigest, Vector]:
        digests_of: dict[tuple[str, str, str, int], list[bytes]] = {}
        for tenant_id, model, strategy, dimension, digest in asked:
            digests_of.setdefault((tenant_id, model, strategy, dimension), []).append(digest)
        found: dict[KnownDigest, Vector] = {}
        for (tenant_id, model, strategy, dimension), digests in digests_of.items():
            with translate_db_errors():
                rows = await self._pool.fetch(
                    QUERIES["known_embeddings"], tenant_id, model, strategy, dimension, digests
                )
            for row in rows:
                digest = bytes(row["content_digest"])
                found[(tenant_id, model, strategy, dimension, digest)] = (
                    row["embedding"].to_numpy().astype(np.float32)
                )
        return found
