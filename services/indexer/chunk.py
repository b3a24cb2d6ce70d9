"""A chunk, as chunking makes it and the sink writes it: its id, place, heading path, text
and the digest of what is embedded. On the ground floor of the indexer, so that the sink and
the queue need not look into the pipeline for it (docs/architecture.md#layers).
"""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass
from typing import Final

HEADING_SEPARATOR: Final = " > "


def embedding_input_of(heading_path: tuple[str, ...], text: str) -> str:
    if not heading_path:
        return text
    return HEADING_SEPARATOR.join(heading_path) + "\n\n" + text


@dataclass(frozen=True)
class Chunk:
    chunk_id: str
    ordinal: int  # 0.. in document order
    heading_path: tuple[str, ...]
    text: str  # the passage shown to users
    content_digest: bytes  # sha256 of embedding_input

    @property
    def embedding_input(self) -> str:
        return embedding_input_of(self.heading_path, self.text)


def chunk_id_of(
    *,
    document_id: uuid.UUID,
    version_number: int,
    strategy_id: str,
    ordinal: int,
    heading_path: tuple[str, ...],
    content_digest: bytes,
) -> str:
    # JSON keeps the fields apart unambiguously (no separator can occur inside one).
    key = json.dumps(
        [
            str(document_id),
            version_number,
            strategy_id,
            ordinal,
            list(heading_path),
            content_digest.hex(),
        ],
        ensure_ascii=False,
        separators=(",", ":"),
    )
    return hashlib.sha256(key.encode("utf-8")).hexdigest()[:32]
