"""What the sink's statements on one version's chunks are about (sink.sql): the document
version, and the index generation its chunks are written under."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

from services.indexer.queue.task import Lease

if TYPE_CHECKING:
    from services.index.generation import IndexGeneration


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
