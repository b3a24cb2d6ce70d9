"""The index's identity: what a document version is indexed as. A generation is one
embedding model with its dimension and one chunking strategy; its chunks live in
``knowledge_chunk`` under that model's name, with an ANN index named after it
(``services.index.ann``). The indexer writes generations, search reads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from services.index.ann import ann_index_name, check_model_name
from services.runtime.errors import ConfigError


@dataclass(frozen=True)
class IndexGeneration:
    """What a document version is indexed as (docs/architecture.md#index-generations)."""

    embedding_model: str
    dimension: int
    chunking_strategy: str

    def __post_init__(self) -> None:
        check_model_name(self.embedding_model)
        if not 0 < self.dimension <= 16000:
            raise ConfigError(f"embedding dimension {self.dimension} out of range")
        if not self.chunking_strategy:
            raise ConfigError("an index generation needs a chunking strategy")

    @property
    def ann_index_name(self) -> str:
        return ann_index_name(self.embedding_model)


@dataclass(frozen=True)
class RegisteredGeneration:
    generation: IndexGeneration
    ann_index_name: str
    created_at: datetime
