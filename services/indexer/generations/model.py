"""`kb index generations`: what the operator asks for and what each command reports.

The decisions that need no database live here (is the request well formed, how a refused
switch is told, how progress is counted); ``store_pg`` carries them out in PostgreSQL
and ``cli`` prints them. See docs/operations.md, "Changing the embedding model".
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final

from services.index.ann import check_model_name
from services.index.generations import SearchGeneration
from services.runtime.errors import BadInput
from services.runtime.indexing.index_failures import ErrorCode

_PROFILE: Final = re.compile(r"^[a-z0-9][a-z0-9_]{0,31}$")
_TENANT: Final = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")

# How many documents a refused switch names (the count says how many there are).
MISSING_SHOWN: Final = 20
# Rows a retire deletes per statement (each in a transaction of its own).
RETIRE_BATCH: Final = 5_000
# Written on the tasks of a retired generation that had not finished.
GENERATION_RETIRED: Final = ErrorCode.GENERATION_RETIRED


@dataclass(frozen=True)
class GenerationSpec:
    """What `create` is asked to build: a profile, a model and its dimension, chunk sizes."""

    provider_profile: str
    embedding_model: str
    dimension: int
    chunk_max_tokens: int
    chunk_overlap_tokens: int

    def __post_init__(self) -> None:
        if not _PROFILE.match(self.provider_profile):
            raise BadInput(
                f"--provider {self.provider_profile!r}: a profile name is lowercase letters, "
                "digits and '_', at most 32"
            )
        try:
            check_model_name(self.embedding_model)
        except ValueError as error:
            raise BadInput(f"--model: {error}") from None
        if not 1 <= self.dimension <= 16000:
            raise BadInput(f"--dimensions {self.dimension}: between 1 and 16000")
        if not 16 <= self.chunk_max_tokens <= 8192:
            raise BadInput(f"--chunk-tokens {self.chunk_max_tokens}: between 16 and 8192")
        # The indexer's own rule (KB_INDEXER_CHUNK_OVERLAP_TOKENS): an overlap of half a
        # chunk or more would repeat most of each chunk in the next.
        if self.chunk_overlap_tokens < 0 or (
            self.chunk_overlap_tokens and self.chunk_overlap_tokens >= self.chunk_max_tokens // 2
        ):
            raise BadInput(
                f"--chunk-overlap {self.chunk_overlap_tokens}: at least 0 and below half of "
                f"--chunk-tokens ({self.chunk_max_tokens})"
            )

    def candidate(self) -> SearchGeneration:
        """The generation as it would be registered (id 0: not yet), to check that its
        profile can serve it before anything is written."""
        return SearchGeneration(
            generation_id=0,
            provider_profile=self.provider_profile,
            embedding_model=self.embedding_model,
            dimension=self.dimension,
            chunk_max_tokens=self.chunk_max_tokens,
            chunk_overlap_tokens=self.chunk_overlap_tokens,
            chunking_settings=None,
            is_default=False,
            state="ACTIVE",
        )


def tenant_ids(values: list[str]) -> list[str]:
    """The tenants named on the command line, checked and without repeats."""
    for value in values:
        if not _TENANT.match(value):
            raise BadInput(f"tenant {value!r}: lowercase letters, digits and '-', at most 63")
    return list(dict.fromkeys(values))


def same_chunks(a: SearchGeneration, spec: GenerationSpec) -> bool:
    """Whether a generation's chunks would be the same rows as ``spec``'s: knowledge_chunk
    tells generations apart by model and chunk settings, not by profile."""
    return (a.embedding_model, a.chunk_max_tokens, a.chunk_overlap_tokens) == (
        spec.embedding_model,
        spec.chunk_max_tokens,
        spec.chunk_overlap_tokens,
    )


class AnnIndexBuild(StrEnum):
    """What `generations create` did about the model's partitioned HNSW index."""

    BUILT = "built"
    PRESENT = "present"  # valid already
    BUSY = "busy"  # another process holds the model's lock (it is building it)
    OFF = "off"  # KB_INDEXER_PARTITION_GRAPHS is false: not built


@dataclass(frozen=True)
class CreateOutcome:
    generation: SearchGeneration
    created: bool  # False: the same setup was live already (a re-run)
    pinned: list[str]  # tenants pinned to the default generation now
    added: list[str]  # tenants built in the generation from now on
    backfill_tasks: int
    ann_index: AnnIndexBuild = AnnIndexBuild.OFF
    # The tenants given a graph of the model's own; None: another process was building them.
    tenant_graphs: list[str] | None = field(default_factory=list)


@dataclass(frozen=True)
class MissingDocument:
    document_id: uuid.UUID
    served_version: int
    built_version: int | None  # None: the generation holds no version of it

    def line(self) -> str:
        built = "none" if self.built_version is None else f"v{self.built_version}"
        return f"{self.document_id}  served v{self.served_version}  built {built}"


class SwitchRefused(BadInput, code="GENERATION_INCOMPLETE"):
    """The target generation does not hold every served version of the tenant: switching
    would make documents unsearchable (or serve an older version)."""

    def __init__(
        self, tenant_id: str, generation_id: int, missing: list[MissingDocument], total: int
    ) -> None:
        self.missing = missing
        self.total = total
        super().__init__(
            f"tenant {tenant_id}: generation {generation_id} does not hold the served version "
            f"of {total} documents (named on stdout); wait for its backfill "
            "(`kb index generations status`), or --force to switch anyway and leave them "
            "unsearchable until it does"
        )


@dataclass(frozen=True)
class SwitchOutcome:
    tenant_id: str
    previous: int  # the generation that served before
    target: int
    rewritten: int  # pointers now naming the target's versions
    dropped: list[MissingDocument] = field(default_factory=list)  # --force
    dropped_total: int = 0
    switched: bool = True  # False: the tenant was served by the target already


@dataclass(frozen=True)
class RetireOutcome:
    generation_id: int
    already_retired: bool
    tasks_ended: int = 0
    chunks_deleted: int = 0
    document_rows_deleted: int = 0
    tasks_deleted: int = 0
    indexes_dropped: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class GenerationSummary:
    """One line of `list`, one card row of the operator page."""

    generation: SearchGeneration
    tenants_serving: int
    tenants_built: int


@dataclass(frozen=True)
class Progress:
    done: int
    pending: int
    failed: int
    chunks: int

    @property
    def total(self) -> int:
        return self.done + self.pending + self.failed

    @property
    def percent(self) -> float:
        """Done out of everything the generation has to hold: 100 with nothing to do."""
        return 100.0 if self.total == 0 else 100.0 * self.done / self.total


@dataclass(frozen=True)
class GenerationStatus:
    summary: GenerationSummary
    progress: Progress
    serving: list[str]  # up to a limit; summary.tenants_serving has the count
    chunks_on_disk: int | None = None  # None: not measured (the page does not)
    bytes_on_disk: int | None = None


def human_bytes(size: int) -> str:
    value = float(size)
    for unit in ("B", "kB", "MB", "GB"):
        if value < 1024 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
