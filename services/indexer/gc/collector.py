"""The collector of superseded chunks: deletes, outside any completion's transaction and in
bounded batches, the versions of each document that no generation serves any more, keeping
``KB_INDEX_KEEP_PREVIOUS`` below the served one (gc.sql: ``delete_superseded_chunks`` says
why that is safe for searches and completions in flight).

Completions mark their document (``mark_document``, in the fenced transaction); every
`kb indexer run` process runs a collector beside its workers, and `kb index gc` runs one
round by hand. Collectors take marked documents with SKIP LOCKED, so any number of them
share the work without waiting for each other.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg
from prometheus_client import Counter

from services.index.generation import CODE_MARK
from services.runtime.db import translate_db_errors
from services.runtime.logging import get_logger
from services.runtime.sql import queries_beside
from services.runtime.transaction import Transaction

QUERIES = queries_beside(__file__, "gc.sql")
log = get_logger(__name__)

CHUNKS_COLLECTED = Counter(
    "kb_index_gc_chunks_deleted_total",
    "Chunk rows of superseded versions deleted by the collector",
)
DOCUMENTS_COLLECTED = Counter(
    "kb_index_gc_documents_total", "Marked documents the collector has cleaned"
)


async def mark_document(
    conn: Transaction, tenant_id: str, document_id: Any, now: datetime | None = None
) -> None:
    """In a completion's transaction: the document may now hold superseded chunks."""
    with translate_db_errors():
        await conn.execute(QUERIES["mark_document"], tenant_id, document_id, now)


@dataclass(frozen=True)
class GcRound:
    documents: int
    chunks: int


class GarbageCollector:
    def __init__(
        self,
        pool: asyncpg.Pool[Any],
        *,
        keep_previous: int,
        batch_rows: int,
    ) -> None:
        self._pool = pool
        self._keep_previous = keep_previous
        self._batch_rows = batch_rows

    async def collect(self, *, max_documents: int) -> GcRound:
        """Up to ``max_documents`` marked documents, one batch each; a document with more
        than a batch of superseded rows stays marked for the next round."""
        documents = chunks = 0
        for _ in range(max_documents):
            taken = await self._collect_one()
            if taken is None:
                break
            documents += 1
            chunks += taken
        return GcRound(documents, chunks)

    async def _collect_one(self) -> int | None:
        async with self._pool.acquire() as conn, conn.transaction():
            with translate_db_errors():
                due = await conn.fetchrow(QUERIES["take_due_document"])
                if due is None:
                    return None
                tenant_id, document_id = due["tenant_id"], due["document_id"]
                status = await conn.execute(
                    QUERIES["delete_superseded_chunks"],
                    tenant_id,
                    document_id,
                    self._keep_previous,
                    self._batch_rows,
                    CODE_MARK,
                )
                deleted = int(status.rsplit(" ", 1)[-1])  # "DELETE <rows>"
                if deleted < self._batch_rows:
                    await conn.execute(QUERIES["forget_document"], tenant_id, document_id)
        CHUNKS_COLLECTED.inc(deleted)
        if deleted < self._batch_rows:
            DOCUMENTS_COLLECTED.inc()
        if deleted:
            log.info(
                "chunks.collected",
                tenant_id=tenant_id,
                document_id=str(document_id),
                chunks=deleted,
            )
        return deleted

    async def run(self, stop: asyncio.Event, *, interval_seconds: float) -> None:
        """Rounds until ``stop``; waits ``interval_seconds`` only after a round with nothing
        to do. A failed round is logged and retried after the interval: collecting is never
        urgent, and a collector must not take its indexer process down."""
        while not stop.is_set():
            try:
                done = await self.collect(max_documents=100)
            except Exception as error:
                log.warning("gc.round_failed", error=str(error))
                done = GcRound(0, 0)
            if done.documents == 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), interval_seconds)
