"""The sink's retirement of superseded versions: a document's chunks of the served
generation that the search pointer has left behind are deleted by the same fenced
transaction that moved it (sink.sql: ``retire_superseded_chunks`` says why that is safe for
searches in flight, for racing versions and for embedding reuse).

Without it a document republished N times keeps N - 1 dead versions in its tenant
partition's HNSW graph and GIN index: search still answers right (it filters by the
pointer), but the ANN walk visits dead neighbours and the index grows without bound.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.index.generation import CODE_MARK, chunking_settings
from services.indexer.queue.task import Lease
from services.indexer.sink.version import version_chunks
from services.runtime.db import translate_db_errors
from services.runtime.logging import get_logger
from services.runtime.sql import queries_beside
from services.runtime.transaction import Transaction

if TYPE_CHECKING:
    from services.index.generation import IndexGeneration

QUERIES = queries_beside(__file__, "sink.sql")

log = get_logger(__name__)


async def retire_superseded(conn: Transaction, lease: Lease, generation: IndexGeneration) -> int:
    """Run inside the fenced complete, right after the pointer switch (the pointer row is
    locked): deletes the document's chunks of ``generation`` -- its model and chunk
    settings, whichever code chunked them -- older than the version served, up to the
    lease's version, and returns how many went."""
    with translate_db_errors():
        status = await conn.execute(
            QUERIES["retire_superseded_chunks"],
            *version_chunks(lease, generation),
            chunking_settings(generation.chunking_strategy),
            CODE_MARK,
        )
    retired = int(status.rsplit(" ", 1)[-1])  # "DELETE <rows>"
    if retired:
        log.info(
            "chunks.retired",
            **lease.log_fields(),
            embedding_model=generation.embedding_model,
            chunking_strategy=generation.chunking_strategy,
            chunks=retired,
        )
    return retired
