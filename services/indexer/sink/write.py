"""One document version's write into the index, as the sink builds it before the fenced
transaction opens (``ChunkWrite``: the COPY records), and what a write says when it is done:
the ``DocumentSearchVersionSwitched`` event of a pointer switch, and the log of a replaced
chunk set. Shared by the write of one completion (pgvector.py) and of a group written
together (together.py)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import numpy.typing as npt

from services.index.generation import IndexGeneration
from services.indexer.sink.stream import CHUNK_RECORD_COLUMNS, chunk_records
from services.indexer.sink.version import ServedPointer, version_chunks
from services.indexer.task import Lease
from services.runtime.logging import get_logger
from services.runtime.messaging.avro import SchemaRegistry
from services.runtime.messaging.events import DOCUMENT_SEARCH_VERSION_SWITCHED, event_id
from services.runtime.messaging.outbox import OutboxEvent, aggregate_key

if TYPE_CHECKING:
    from collections.abc import Mapping

    from services.indexer.chunk import Chunk

log = get_logger(__name__)

INDEX_TABLE: Final = "knowledge_chunk"
# The columns of a ChunkWrite's records: the version's key, then chunk_records' columns.
INDEX_COLUMNS: Final = (
    "tenant_id",
    "document_id",
    "version_number",
    "embedding_model",
    "chunking_strategy",
    "embedding_dimension",
    *CHUNK_RECORD_COLUMNS,
)


@dataclass(frozen=True)
class ChunkWrite:
    """One version's chunks, ready to COPY into knowledge_chunk (INDEX_COLUMNS): built
    before the transaction opens. A large document's are staged instead (stream.py):
    ``staged`` of them, no records, moved in from the staging table."""

    lease: Lease
    generation: IndexGeneration
    records: list[tuple[Any, ...]]
    # The search generation the chunks build (generations.py); None: no search generation
    # is known (a sink used without one: the pointer moves as it did before them).
    search_generation_id: int | None = None
    staged: int | None = None

    @property
    def chunk_count(self) -> int:
        return len(self.records) if self.staged is None else self.staged


def switched_event(
    registry: SchemaRegistry,
    lease: Lease,
    generation: IndexGeneration,
    chunk_count: int,
    switched: Mapping[str, Any],
) -> OutboxEvent:
    """The ``DocumentSearchVersionSwitched`` event of a pointer switch (``switched``: the
    row switch_search_version returned)."""
    id_ = switched_event_id(lease, generation)
    payload = registry.encode(
        DOCUMENT_SEARCH_VERSION_SWITCHED,
        {
            "eventId": str(id_),
            "tenantId": lease.tenant_id,
            "tier": lease.tier,
            "documentId": str(lease.document_id),
            "versionNumber": lease.version_number,
            "previousVersionNumber": switched["previous_version"],
            "embeddingModel": generation.embedding_model,
            "chunkCount": chunk_count,
            "taskId": str(lease.task_id),
            # The ingest command that published the version (docs/architecture.md#publish-
            # by-event), so its producer correlates without polling.
            "commandId": switched.get("command_id"),
            "occurredAt": switched["switched_at"],
        },
    )
    return OutboxEvent(
        event_type=DOCUMENT_SEARCH_VERSION_SWITCHED,
        tenant_id=lease.tenant_id,
        tier=lease.tier,
        aggregate_key=aggregate_key(lease.tenant_id, lease.document_id),
        payload=payload,
        event_id=id_,
    )


def switched_event_id(lease: Lease, generation: IndexGeneration) -> uuid.UUID:
    """One id per switch. The lease attempt is part of it: a pointer switches to a version
    once in normal operation, but a second time after a repair recreated a lost pointer
    (`kb index check --repair` re-runs the version's task under a new lease attempt), and
    that second switch is an event of its own, not a duplicate of the first."""
    return event_id(
        DOCUMENT_SEARCH_VERSION_SWITCHED,
        lease.tenant_id,
        lease.document_id,
        lease.version_number,
        generation.embedding_model,
        str(lease.lease_attempt),
    )


def log_replaced(
    lease: Lease,
    generation: IndexGeneration,
    served: ServedPointer | None,
    replaced: str | None,
    deleted: int,
    chunk_count: int,
) -> None:
    """Said when the write replaced rows of its version: the served set (a re-run at the
    served version) or an earlier run's of its own strategy."""
    if replaced is None and not deleted:
        return
    log.info(
        "chunks.replaced",
        **lease.log_fields(),
        embedding_model=generation.embedding_model,
        chunking_strategy=generation.chunking_strategy,
        served_strategy=replaced,
        served_chunks=None if served is None else served.chunk_count,
        deleted=deleted,
        chunks=chunk_count,
    )


def prepare_write(
    lease: Lease,
    generation: IndexGeneration,
    chunks: Sequence[Chunk],
    embeddings: npt.NDArray[Any],
    *,
    search_generation_id: int | None = None,
) -> ChunkWrite:
    """Checks the embeddings against the chunks and the generation, and builds the COPY
    records (INDEX_COLUMNS), so the transaction only sends them."""
    key = (*version_chunks(lease, generation), generation.dimension)
    records = [(*key, *record) for record in chunk_records(lease, generation, chunks, embeddings)]
    return ChunkWrite(lease, generation, records, search_generation_id)
