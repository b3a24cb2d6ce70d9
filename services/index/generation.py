"""The index's identity: what a document version is indexed as. A generation is one
embedding model with its dimension and one chunking strategy; its chunks live in
``knowledge_chunk`` under that model's name, its HNSW graphs named after it
(``services.index.ann``). The indexer writes generations, search reads them.

A strategy id ends with the digest of the code that chunked: strategies that differ only
there are the same chunk settings chunked by older or newer code (``chunking_settings``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Final

from services.index.ann import ann_index_name, check_model_name
from services.runtime.errors import ConfigError

# What ends a chunking strategy id: the digest of the code that chunked
# (services/indexer/pipeline/chunking_code.py); everything before it names the settings.
CODE_MARK: Final = ":code="


def chunking_settings(strategy: str) -> str:
    """A chunking strategy id without the code that chunked. Strategies of the same settings
    are one generation chunked by older or newer code: a re-run at the served version
    replaces the older code's chunks (the sink's replace_version_chunks), and `kb index
    check` names them. Other settings are another generation, built beside the served one.
    An id written before the code was part of it is all settings."""
    return strategy.split(CODE_MARK, 1)[0]


@dataclass(frozen=True)
class IndexGeneration:
    """What a document version is indexed as (docs/architecture.md#index-generations)."""

    embedding_model: str
    dimension: int
    chunking_strategy: str
    # The (name, version) pairs of the code that chunks, whose digest the strategy id
    # carries: registered with the generation so `kb index check` can say what changed.
    # Not part of the identity (the id already is); empty when not known.
    chunking_code: tuple[tuple[str, str], ...] = field(default=(), compare=False)

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
