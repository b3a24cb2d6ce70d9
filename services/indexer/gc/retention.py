"""The retention of superseded versions' content (migration 0032, retention.sql): once a
version has been superseded for ``KB_RETENTION_SUPERSEDED_DAYS`` by the database's clock, its
chunks in every generation and then its bytes go; its row (number, hashes, size, times), its
tasks, the tombstones and the erasure audit stay, and ``content_removed_at`` says what
happened.

Each batch is one short transaction over at most ``batch_versions`` versions and
``batch_rows`` chunk rows. A version's content is emptied only in the batch that finds none
of its chunks left, so a collector stopped anywhere (killed, a lost connection) leaves every
version either whole, or with part of its unserved chunks gone and its content still there:
the next pass finishes it. Every `kb indexer run` runs it beside the collector of superseded
chunks (``RetentionCollector.run``), and `kb index retention` runs one pass by hand.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg
from prometheus_client import Counter, Gauge

from services.indexer.gc.settings import RetentionSettings
from services.runtime.logging import get_logger
from services.runtime.pg.db import translate_db_errors
from services.runtime.pg.sql import queries_beside

QUERIES = queries_beside(__file__, "retention.sql")
log = get_logger(__name__)

# What this process removed: versions (their content), bytes, chunk rows of every generation.
REMOVED = {
    kind: Counter(f"kb_retention_{kind}_removed", f"{what} retention removed (this process)")
    for kind, what in (
        ("versions", "Superseded versions whose content"),
        ("bytes", "Bytes of superseded versions' content"),
        ("chunks", "Chunk rows of superseded versions"),
    )
}
# Sampled from the database after each pass: the same value in every process.
TOTALS = {
    "deleted_documents": Gauge("kb_documents_deleted", "Deleted documents (database-wide)"),
    "erased_documents": Gauge("kb_documents_erased", "Documents whose erase finished"),
    "erasures_in_progress": Gauge(
        "kb_document_erasures_in_progress", "Erasures started and not finished"
    ),
    "oldest_erasure_in_progress_seconds": Gauge(
        "kb_document_erasure_oldest_in_progress_seconds",
        "Age of the oldest erasure not finished (0: none)",
    ),
    "removed_versions": Gauge(
        "kb_retention_removed_versions", "Versions whose content retention removed, ever"
    ),
    "removed_bytes": Gauge(
        "kb_retention_removed_bytes", "Bytes of the versions retention removed, ever"
    ),
}


@dataclass(frozen=True)
class RetentionPass:
    versions: int  # versions whose content was removed
    bytes: int  # their content's bytes
    chunks: int  # chunk rows deleted (those of versions still being emptied included)


class RetentionCollector:
    def __init__(self, pool: asyncpg.Pool[Any], settings: RetentionSettings) -> None:
        self._pool = pool
        self._settings = settings

    async def collect(
        self, *, max_batches: int = 1000, now: datetime | None = None
    ) -> RetentionPass:
        """Batches until none is due (or ``max_batches``). ``now``: the database's clock
        when None (tests inject one); a period of 0 days keeps everything."""
        versions = size = chunks = 0
        if self._settings.superseded_days == 0:
            return RetentionPass(0, 0, 0)
        for _ in range(max_batches):
            done, taken = await self._batch(now)
            versions += done.versions
            size += done.bytes
            chunks += done.chunks
            # Nothing taken: nothing is due. Taken but nothing done: what was taken changed
            # under the batch (a task requeued), and the next take will not return it.
            if not taken or (done.versions == 0 and done.chunks == 0):
                break
        return RetentionPass(versions, size, chunks)

    async def _batch(self, now: datetime | None) -> tuple[RetentionPass, int]:
        async with self._pool.acquire() as conn, conn.transaction():
            with translate_db_errors():
                due = await conn.fetch(
                    QUERIES["take_retention_due"],
                    self._settings.superseded_days,
                    self._settings.batch_versions,
                    now,
                )
                if not due:
                    return RetentionPass(0, 0, 0), 0
                keys = _columns(due)
                await conn.fetch(QUERIES["hold_finished_tasks"], *keys)
                deleted = await conn.fetch(
                    QUERIES["delete_retained_chunks"], *keys, self._settings.batch_rows
                )
                removed = []
                if len(deleted) < self._settings.batch_rows:
                    removed = await conn.fetch(QUERIES["remove_retained_content"], *keys, now)
        done = RetentionPass(len(removed), sum(row["bytes"] for row in removed), len(deleted))
        REMOVED["versions"].inc(done.versions)
        REMOVED["bytes"].inc(done.bytes)
        REMOVED["chunks"].inc(done.chunks)
        for row in removed:
            log.info(
                "retention.removed",
                tenant_id=row["tenant_id"],
                document_id=str(row["document_id"]),
                version_number=row["version_number"],
                bytes=row["bytes"],
            )
        return done, len(due)

    async def sample_totals(self, now: datetime | None = None) -> dict[str, float]:
        """The lifecycle's database-wide counts, set on the gauges and returned."""
        with translate_db_errors():
            row = await self._pool.fetchrow(QUERIES["retention_totals"], now)
        assert row is not None  # one row of sub-selects, always
        totals = {name: float(row[name]) for name in TOTALS}
        for name, value in totals.items():
            TOTALS[name].set(value)
        return totals

    async def run(self, stop: asyncio.Event) -> None:
        """A pass and a sample every ``KB_RETENTION_INTERVAL_SECONDS`` until ``stop``. A
        failed pass is logged and tried again at the next interval: retention is never
        urgent, and it must not take its indexer process down."""
        while not stop.is_set():
            try:
                await self.collect()
                await self.sample_totals()
            except Exception as error:
                log.warning("retention.pass_failed", error=str(error))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self._settings.interval_seconds)


def _columns(due: Sequence[Any]) -> tuple[list[str], list[uuid.UUID], list[int]]:
    """The batch's versions as the three arrays the statements unnest."""
    return (
        [row["tenant_id"] for row in due],
        [row["document_id"] for row in due],
        [row["version_number"] for row in due],
    )
