"""The search benches' data: the rows of published, indexed documents they load
(``bench.search_scale_single``, ``bench.search_scale_load``, ``bench.quality_index``).

A bench document is version 1 of itself, published, readable by its principals, behind its
search pointer, with its chunks of one model and chunking strategy: the rows the publisher
and the indexer's sink would have written, copied straight into the tables.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import asyncpg

Row = tuple[Any, ...]

DOCUMENT_COLUMNS = [
    "tenant_id",
    "document_id",
    "title",
    "revision",
    "latest_version",
    "published_version",
]
VERSION_COLUMNS = [
    "tenant_id",
    "document_id",
    "version_number",
    "content",
    "media_type",
    "sha256",
    "size_bytes",
    "status",
]
ACL_COLUMNS = ["tenant_id", "document_id", "principal", "permission"]
CHUNK_COLUMNS = [
    "tenant_id",
    "document_id",
    "version_number",
    "embedding_model",
    "chunk_id",
    "ordinal",
    "heading_path",
    "text",
    "content_digest",
    "embedding_dimension",
    "embedding",
    "chunking_strategy",
]
POINTER_COLUMNS = [
    "tenant_id",
    "document_id",
    "version_number",
    "embedding_model",
    "chunking_strategy",
    "chunk_count",
]


def chunk_row(
    tenant: str,
    document_id: uuid.UUID,
    model: str,
    strategy: str,
    chunk_id: str,
    ordinal: int,
    heading_path: Sequence[str],
    text: str,
    vector: Any,
    *,
    digest: bytes | None = None,
) -> Row:
    """One chunk of a document's version 1, in ``CHUNK_COLUMNS`` order (the digest: of the
    text unless given)."""
    return (
        tenant,
        document_id,
        1,
        model,
        chunk_id,
        ordinal,
        list(heading_path),
        text,
        digest if digest is not None else hashlib.sha256(text.encode()).digest(),
        len(vector),
        vector,
        strategy,
    )


@dataclass
class PublishedRows:
    """Published documents of one model and chunking strategy, gathered for ``copy``; their
    chunks go into ``chunks`` (``chunk_row``)."""

    model: str
    strategy: str
    documents: list[Row] = field(default_factory=list)
    versions: list[Row] = field(default_factory=list)
    acls: list[Row] = field(default_factory=list)
    chunks: list[Row] = field(default_factory=list)
    pointers: list[Row] = field(default_factory=list)

    def add_document(
        self,
        tenant: str,
        document_id: uuid.UUID,
        title: str,
        content: bytes,
        principals: Iterable[str],
        *,
        media_type: str = "text/plain",
        chunk_count: int | None = None,
    ) -> None:
        """The document at version 1, published, readable by ``principals``, its search
        pointer at that version (``chunk_count``: what the sink would have recorded)."""
        self.documents.append((tenant, document_id, title, 1, 1, 1))
        self.versions.append(
            (
                tenant,
                document_id,
                1,
                content,
                media_type,
                hashlib.sha256(content).digest(),
                len(content),
                "PUBLISHED",
            )
        )
        self.acls.extend((tenant, document_id, principal, "READ") for principal in principals)
        self.pointers.append((tenant, document_id, 1, self.model, self.strategy, chunk_count))

    async def copy(self, conn: asyncpg.Connection[Any]) -> None:
        """COPY every row gathered, referenced tables first (the vector codec registered on
        ``conn``)."""
        for table, columns, records in (
            ("document", DOCUMENT_COLUMNS, self.documents),
            ("document_version", VERSION_COLUMNS, self.versions),
            ("document_acl", ACL_COLUMNS, self.acls),
            ("knowledge_chunk", CHUNK_COLUMNS, self.chunks),
            ("document_search_version", POINTER_COLUMNS, self.pointers),
        ):
            if records:
                await conn.copy_records_to_table(table, records=records, columns=columns)
