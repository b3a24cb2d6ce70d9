"""Search generations: the operator's name for one embedding setup -- a provider profile, a
model and its dimension, chunk settings -- that a tenant's documents are built in and that
serves its search (migration 0022, docs/architecture.md#index-generations).

A tenant is served by one generation at a time and may be built in others beside it; `kb
index generations switch` moves its search in one transaction. Newer chunking code does not
make another generation: its chunks are told apart by ``chunking_settings`` (the strategy id
without the code digest, services.index.generation.chunking_settings).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

# KB_EMBEDDING_* configures this profile; KB_EMBEDDING_PROFILE_<NAME>_* the others.
DEFAULT_PROFILE: Final = "default"

GenerationState = Literal["ACTIVE", "RETIRING", "RETIRED"]


@dataclass(frozen=True)
class SearchGeneration:
    generation_id: int
    provider_profile: str
    embedding_model: str
    dimension: int
    chunk_max_tokens: int
    chunk_overlap_tokens: int
    # Recorded by the first indexer that builds the generation; None until then.
    chunking_settings: str | None
    # The generation the indexers are configured with: it serves every tenant that was
    # never pinned to one (tenant_search_generation has no row of it).
    is_default: bool
    state: GenerationState

    @classmethod
    def from_record(cls, row: Mapping[str, Any]) -> SearchGeneration:
        """From a row of ``search_generation`` (or any row with its column names)."""
        return cls(
            generation_id=int(row["generation_id"]),
            provider_profile=str(row["provider_profile"]),
            embedding_model=str(row["embedding_model"]),
            dimension=int(row["dimension"]),
            chunk_max_tokens=int(row["chunk_max_tokens"]),
            chunk_overlap_tokens=int(row["chunk_overlap_tokens"]),
            chunking_settings=row["chunking_settings"],
            is_default=bool(row["is_default"]),
            state=row["state"],
        )

    @property
    def active(self) -> bool:
        return self.state == "ACTIVE"

    def describe(self) -> str:
        """How logs and CLI messages name it."""
        return (
            f"generation {self.generation_id} ({self.provider_profile}: "
            f"{self.embedding_model}, {self.dimension} dimensions, "
            f"{self.chunk_max_tokens} tokens a chunk)"
        )
