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
import collections
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import asyncpg
from prometheus_client import Counter

from services.index.generation import CODE_MARK
from services.indexer.gc.settings import GcSettings
from services.runtime.logging import get_logger
from services.runtime.pg.db import translate_db_errors
from services.runtime.pg.sql import queries_beside
from services.runtime.pg.transaction import Transaction

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
    await mark_documents(conn, [(tenant_id, document_id)], now)


async def mark_documents(
    conn: Transaction, documents: Sequence[tuple[str, Any]], now: datetime | None = None
) -> None:
    """``mark_document`` for several (tenant, document) pairs, in that order."""
    with translate_db_errors():
        await conn.execute(
            QUERIES["mark_document"],
            [tenant_id for tenant_id, _ in documents],
            [document_id for _, document_id in documents],
            now,
        )


# Documents per transaction: their marks are held until it commits, and a completion of one
# of them waits for that (gc.sql: mark_document).
ROUND_DOCUMENTS = 32


@dataclass(frozen=True)
class GcRound:
    # Marked documents taken, superseded rows deleted, and (not compared: how many rounds it
    # took) documents found clean, whose marks went.
    documents: int
    chunks: int
    clean: int = field(default=0, compare=False)


class GarbageCollector:
    def __init__(self, pool: asyncpg.Pool[Any], settings: GcSettings) -> None:
        self._pool = pool
        self._keep_previous = settings.keep_previous
        self._batch_rows = settings.gc_batch_rows

    async def collect(self, *, max_documents: int) -> GcRound:
        """Up to ``max_documents`` marked documents, in rounds of at most ``ROUND_DOCUMENTS``;
        a tenant's documents of one round share a batch of ``batch_rows``, and when it was
        full they stay marked for the next round."""
        documents = chunks = clean = 0
        while documents < max_documents:
            done = await self._collect_round(min(ROUND_DOCUMENTS, max_documents - documents))
            if not done.documents:
                break
            documents += done.documents
            chunks += done.chunks
            clean += done.clean
        return GcRound(documents, chunks, clean)

    async def _collect_round(self, limit: int) -> GcRound:
        """One transaction: the oldest marked documents no one holds, their superseded rows
        deleted a tenant at a time, the marks of the clean ones deleted."""
        deleted: collections.Counter[tuple[str, Any]] = collections.Counter()
        clean: list[tuple[str, Any]] = []
        async with self._pool.acquire() as conn, conn.transaction():
            with translate_db_errors():
                due = await conn.fetch(QUERIES["take_due_documents"], limit)
                by_tenant: dict[str, list[Any]] = {}
                for row in due:
                    by_tenant.setdefault(row["tenant_id"], []).append(row["document_id"])
                for tenant_id, document_ids in by_tenant.items():
                    [batch] = await conn.fetch(
                        QUERIES["delete_superseded_chunks"],
                        tenant_id,
                        document_ids,
                        self._keep_previous,
                        self._batch_rows,
                        CODE_MARK,
                    )
                    deleted.update((tenant_id, document_id) for document_id in batch["removed"])
                    # What it removed says nothing: rows another session deleted while the
                    # batch waited on their locks are skipped, with more rows left past them.
                    if batch["seen"] < self._batch_rows:
                        clean.extend((tenant_id, document_id) for document_id in document_ids)
                if clean:
                    await conn.execute(
                        QUERIES["forget_documents"],
                        [tenant_id for tenant_id, _ in clean],
                        [document_id for _, document_id in clean],
                    )
        CHUNKS_COLLECTED.inc(sum(deleted.values()))
        DOCUMENTS_COLLECTED.inc(len(clean))
        for (tenant_id, document_id), chunks in sorted(deleted.items()):
            log.info(
                "chunks.collected",
                tenant_id=tenant_id,
                document_id=str(document_id),
                chunks=chunks,
            )
        return GcRound(len(due), sum(deleted.values()), len(clean))

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
