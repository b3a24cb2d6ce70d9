"""Re-runs of succeeded tasks, as an operator gets them: after the run has settled, a seeded
sample of served versions loses one chunk each (what a restore from an older backup or a
hand-edited row leaves), `kb index check --repair` finds the drift (CHUNKS_MISSING) and
re-runs each version's SUCCEEDED task, and the version must then hold exactly the chunks
it held before: the same ids, ordinals and texts."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import asyncpg

from kbtools.chaos.checks.queries import QUERIES
from kbtools.chaos.checks.result import RERUN_SAME_CHUNKS, CheckResult

# chunk id -> (ordinal, md5 of its text)
ChunkSet = dict[str, tuple[int, str]]


@dataclass(frozen=True)
class ServedVersion:
    tenant_id: str
    document_id: str
    version_number: int
    embedding_model: str
    task_id: str

    def describe(self) -> str:
        return (
            f"{self.tenant_id}/{self.document_id} v{self.version_number} ({self.embedding_model})"
        )


def sample_size(documents: int) -> int:
    return max(5, min(40, documents // 25))


async def pick(conn: asyncpg.Connection[Any], seed: int, count: int) -> list[ServedVersion]:
    """``count`` served versions with chunks, drawn from the seed."""
    rows = await conn.fetch(QUERIES["rerun_candidates"])
    served = [ServedVersion(*row) for row in rows]
    return random.Random(seed * 31 + 7).sample(served, min(count, len(served)))


async def chunk_sets(
    conn: asyncpg.Connection[Any], versions: list[ServedVersion]
) -> dict[ServedVersion, ChunkSet]:
    sets: dict[ServedVersion, ChunkSet] = {}
    for version in versions:
        rows = await conn.fetch(
            QUERIES["version_chunk_set"],
            version.tenant_id,
            version.document_id,
            version.version_number,
            version.embedding_model,
        )
        sets[version] = {row["chunk_id"]: (row["ordinal"], row["md5"]) for row in rows}
    return sets


async def damage(conn: asyncpg.Connection[Any], versions: list[ServedVersion]) -> None:
    """Delete each version's last chunk: the drift that makes the repair re-run its task."""
    for version in versions:
        await conn.execute(
            QUERIES["damage_version"],
            version.tenant_id,
            version.document_id,
            version.version_number,
            version.embedding_model,
        )


async def reruns(
    conn: asyncpg.Connection[Any], versions: list[ServedVersion]
) -> dict[ServedVersion, int]:
    """How often the tasks of each version were re-run (requeued from SUCCEEDED). Any task
    of the version: the repair re-runs the version's task of the tenant's serving
    generation, which for a tenant switched to a new generation may be another task than
    the one the pointer names (both write the served set)."""
    counts: dict[ServedVersion, int] = {}
    for version in versions:
        counts[version] = await conn.fetchval(
            QUERIES["drift_reruns"],
            version.tenant_id,
            version.document_id,
            version.version_number,
        )
    return counts


def compare(
    before: dict[ServedVersion, ChunkSet],
    after: dict[ServedVersion, ChunkSet],
    reruns_before: dict[ServedVersion, int],
    reruns_after: dict[ServedVersion, int],
    result: CheckResult,
) -> None:
    """Each sampled version was re-run and holds exactly the chunks it held before."""
    for version, chunks in before.items():
        now = after.get(version, {})
        if reruns_after.get(version, 0) <= reruns_before.get(version, 0):
            result.violate(RERUN_SAME_CHUNKS, f"{version.describe()}: no task of it re-ran")
        elif now != chunks:
            lost = sorted(set(chunks) - set(now))
            new = sorted(set(now) - set(chunks))
            changed = sorted(c for c in set(chunks) & set(now) if chunks[c] != now[c])
            result.violate(
                RERUN_SAME_CHUNKS,
                f"{version.describe()}: {len(chunks)} chunks before, {len(now)} after; "
                f"ids gone {lost[:3]}, new {new[:3]}, ordinal or text changed {changed[:3]}",
            )
    result.figures["succeeded tasks re-run and compared"] = len(before)


@dataclass
class RerunEvidence:
    before: dict[ServedVersion, ChunkSet]
    after: dict[ServedVersion, ChunkSet]
    reruns_before: dict[ServedVersion, int]
    reruns_after: dict[ServedVersion, int]
    repair_status: int
    repair_output: str

    def check(self, result: CheckResult) -> None:
        compare(self.before, self.after, self.reruns_before, self.reruns_after, result)
        if self.repair_status != 0:
            lines = self.repair_output.strip().splitlines()
            result.violate(
                RERUN_SAME_CHUNKS,
                f"kb index check --repair exited {self.repair_status}: "
                + " / ".join(lines[-3:])[:300],
            )


async def prepare(
    url: str, seed: int, count: int
) -> tuple[dict[ServedVersion, ChunkSet], dict[ServedVersion, int]]:
    """The sample's chunk sets and re-run counts, then the sample damaged."""
    conn = await asyncpg.connect(url)
    try:
        versions = await pick(conn, seed, count)
        before = await chunk_sets(conn, versions)
        counts = await reruns(conn, versions)
        await damage(conn, versions)
    finally:
        await conn.close()
    return before, counts


async def reread(
    url: str, versions: list[ServedVersion]
) -> tuple[dict[ServedVersion, ChunkSet], dict[ServedVersion, int]]:
    conn = await asyncpg.connect(url)
    try:
        return await chunk_sets(conn, versions), await reruns(conn, versions)
    finally:
        await conn.close()
