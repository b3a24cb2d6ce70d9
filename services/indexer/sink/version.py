"""What the sink's statements on one version's chunks are about (sink.sql): the document
version, the index generation its chunks are written under, and the search pointer as the
write found it."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

from services.index.generation import chunking_settings
from services.indexer.task import Lease
from services.runtime.pg.sql import queries_beside

if TYPE_CHECKING:
    from services.index.generation import IndexGeneration

QUERIES = queries_beside(__file__, "sink.sql")


def version_chunks(
    lease: Lease, generation: IndexGeneration
) -> tuple[str, uuid.UUID, int, str, str]:
    """The parameters these statements begin with: tenant, document, version (the lease's),
    embedding model and chunking strategy (the generation's)."""
    return (
        lease.tenant_id,
        lease.document_id,
        lease.version_number,
        generation.embedding_model,
        generation.chunking_strategy,
    )


@dataclass(frozen=True)
class ServedPointer:
    """The document's search pointer, locked by the write (``lock_search_pointer``)."""

    version_number: int
    embedding_model: str
    chunking_strategy: str | None
    chunk_count: int | None
    # Set: the pointer is a tombstone, the document was deleted (migration 0030).
    deleted_at: datetime | None = None

    def replaces(self, lease: Lease, generation: IndexGeneration) -> bool:
        """Whether a write of ``generation`` at ``lease``'s version replaces the chunk set
        this pointer serves: it serves that version under the same model and chunk settings
        (a re-run at the served version, chunked by the same or newer code). Another model or
        other settings is a generation built beside the served one: it is not switched to
        here. A pointer naming no strategy (written by hand) serves nothing: replaced."""
        if (
            self.version_number != lease.version_number
            or self.embedding_model != generation.embedding_model
        ):
            return False
        served = self.chunking_strategy
        return served is None or chunking_settings(served) == chunking_settings(
            generation.chunking_strategy
        )


def not_switched_reason(
    served: ServedPointer | None, lease: Lease, generation: IndexGeneration
) -> str:
    """Why a write at ``lease``'s version left the pointer ``served`` as it was (a log
    field: a few fixed values)."""
    if served is None or served.version_number > lease.version_number:
        # No pointer, and none inserted: a newer version's switch committed meanwhile, or
        # the pointer was deleted after serving a newer one (its high-water mark).
        return "pointer_at_newer_version"
    if not served.replaces(lease, generation):
        return "pointer_serves_another_generation"
    return "pointer_serves_this_chunk_set"


def replaced_strategy(
    served: ServedPointer | None, lease: Lease, generation: IndexGeneration
) -> str | None:
    """The strategy whose served chunks the write replaces (``replaces``); ``None`` when it
    replaces nothing, or a pointer that named no strategy."""
    if served is None or not served.replaces(lease, generation):
        return None
    return served.chunking_strategy
