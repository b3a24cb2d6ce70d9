"""Completions written together (services/indexer/sink/together.py), on real PostgreSQL: a
group's writes in one set of statements leave the index exactly as the same writes
committed one by one, in every case a completion meets (a first pointer, a newer version, a
version finishing late, a re-run at the served version with the same or newer chunking
code, a retired or no longer serving generation is covered by the single write's tests);
a lost lease or a failing write in such a group drops that task's writes only."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from typing import Any

import asyncpg
import numpy as np
import pytest

from services.index.generation import CODE_MARK, IndexGeneration
from services.indexer.queue.store_pg import PgTaskQueue
from services.indexer.sink.pgvector import PgVectorSink, VersionWrite
from services.indexer.sink.write import INDEX_COLUMNS
from services.indexer.task import Lease
from services.runtime.errors import LeaseLost
from services.runtime.pg.db import _init_connection, create_pool_without_session_reset
from services.runtime.settings import RuntimeSettings
from tests.support import versions
from tests.support.tasks import CreatedTask, create_task

pytestmark = pytest.mark.integration

DIMENSION = 8
SETTINGS = "heading-semchunk-v1:max=256"
NEW = IndexGeneration("test-together-8", DIMENSION, SETTINGS + CODE_MARK + "new")
OLD = IndexGeneration("test-together-8", DIMENSION, SETTINGS + CODE_MARK + "old")
ROLES = ("first", "forward", "late", "same_rerun", "newer_code_rerun")


class Scenario:
    """One tenant's documents, each brought to the state its role needs, and the leases of
    the completions still to write (one per role)."""

    def __init__(self, pool: asyncpg.Pool[Any], queue: PgTaskQueue, sink: PgVectorSink) -> None:
        self.pool, self.queue, self.sink = pool, queue, sink
        self.documents: dict[str, uuid.UUID] = {}
        self.pending: dict[str, Lease] = {}
        self.generation_id = 0

    def write(self, lease: Lease, generation: IndexGeneration, texts: list[str]) -> VersionWrite:
        chunks = versions.make_chunks(
            lease.document_id, lease.version_number, texts, generation.chunking_strategy
        )
        vectors = np.full((len(chunks), DIMENSION), 1 / np.sqrt(DIMENSION), dtype=np.float32)
        write = self.sink.writer(
            lease, generation, chunks, vectors, search_generation_id=self.generation_id
        )
        assert isinstance(write, VersionWrite)
        return write

    async def claim_one(self, task_id: uuid.UUID) -> Lease:
        leases = await self.queue.claim("standard", "w1", lease_seconds=60, limit=50)
        [lease] = [lease for lease in leases if lease.task_id == task_id]
        return lease

    async def complete_alone(self, lease: Lease, generation: IndexGeneration) -> None:
        texts = [f"version {lease.version_number}", "a second chunk"]
        await self.queue.complete(lease, in_transaction=self.write(lease, generation, texts))

    async def acl(self, created: CreatedTask, version: int, principal: str) -> None:
        await self.pool.execute(
            "INSERT INTO document_version_acl (tenant_id, document_id, version_number,"
            " principal, permission) VALUES ($1, $2, $3, $4, 'READ')",
            created.tenant_id,
            created.document_id,
            version,
            principal,
        )

    async def prepare(self, tenant_id: str) -> None:
        for role in ROLES:
            created = await create_task(self.pool, tenant_id=tenant_id)
            self.documents[role] = created.document_id
            await self.acl(created, 1, f"group:{role}-v1")
            first = await self.claim_one(created.task_id)
            if role == "first":
                self.pending[role] = first
                continue
            if role == "late":
                # Version 2 is served before version 1 finishes.
                second = await versions.publish_version(self.pool, created, 2)
                later = await self.claim_one(second)
                await self.complete_alone(later, NEW)
                self.pending[role] = first
                continue
            await self.complete_alone(first, OLD if role == "newer_code_rerun" else NEW)
            if role == "forward":
                task = await versions.publish_version(self.pool, created, 2)
                await self.acl(created, 2, f"group:{role}-v2")
            else:
                # A re-run at the served version (`kb index check --repair`).
                task = created.task_id
                rerun = await self.queue.rerun_succeeded(
                    task, by="test", budget=3, reason=("OLDER_CHUNKING", "test")
                )
                assert rerun is not None
            self.pending[role] = await self.claim_one(task)

    def final_writes(self) -> list[VersionWrite]:
        return [
            self.write(
                self.pending[role],
                NEW,
                [f"final {role} of {self.pending[role].version_number}", "its second chunk"],
            )
            for role in ROLES
        ]

    async def state(self) -> dict[str, Any]:
        """What the index holds of each role's document, named by role."""
        state: dict[str, Any] = {}
        for role, document in self.documents.items():
            state[role] = {
                "chunks": [
                    tuple(row)
                    for row in await self.pool.fetch(
                        "SELECT version_number, embedding_model, chunking_strategy, ordinal,"
                        " text FROM knowledge_chunk WHERE document_id = $1 ORDER BY 1, 2, 3, 4",
                        document,
                    )
                ],
                "pointer": tuple(
                    await self.pool.fetchrow(
                        "SELECT version_number, chunking_strategy, chunk_count"
                        " FROM document_search_version WHERE document_id = $1",
                        document,
                    )
                    or ()
                ),
                "generation_versions": [
                    tuple(row)
                    for row in await self.pool.fetch(
                        "SELECT generation_id, version_number, chunking_strategy, chunk_count"
                        " FROM document_generation_version WHERE document_id = $1 ORDER BY 1",
                        document,
                    )
                ],
                "served_acl": sorted(
                    row["principal"]
                    for row in await self.pool.fetch(
                        "SELECT principal FROM document_acl WHERE document_id = $1", document
                    )
                ),
                "events": await self.pool.fetchval(
                    "SELECT count(*) FROM outbox WHERE event_type ="
                    " 'DocumentSearchVersionSwitched' AND aggregate_key LIKE $1",
                    f"%/{document}",
                ),
                "marked": await self.pool.fetchval(
                    "SELECT count(*) FROM index_gc_due WHERE document_id = $1", document
                ),
                "tasks": sorted(
                    row["status"]
                    for row in await self.pool.fetch(
                        "SELECT status FROM index_task WHERE document_id = $1", document
                    )
                ),
            }
        return state


async def scenario_for(
    pool: asyncpg.Pool[Any], tenant_id: str, beside: Scenario | None = None
) -> Scenario:
    """``tenant_id``'s scenario; with ``beside``, on that one's queue and sink (its group
    commits)."""
    queue = PgTaskQueue(pool) if beside is None else beside.queue
    sink = PgVectorSink(pool) if beside is None else beside.sink
    await sink.ensure_generation(NEW)
    default = await sink.register_default(NEW, chunk_max_tokens=256, chunk_overlap_tokens=0)
    scenario = Scenario(pool, queue, sink)
    scenario.generation_id = default.generation_id
    await scenario.prepare(tenant_id)
    return scenario


async def test_a_group_written_together_leaves_what_single_writes_leave(
    pool: asyncpg.Pool[Any],
) -> None:
    alone = await scenario_for(pool, "alone")
    # Two tenants in one group: each statement of the group covers both.
    together = await scenario_for(pool, "together-a")
    beside = await scenario_for(pool, "together-b", beside=together)

    for write in alone.final_writes():
        await alone.queue.complete(write.lease, in_transaction=write)
    assert alone.queue.completions.written_as_set == 0
    writes = [*together.final_writes(), *beside.final_writes()]
    await asyncio.gather(
        *(together.queue.complete(write.lease, in_transaction=write) for write in writes)
    )
    assert together.queue.completions.written_as_set == 1

    expected = await alone.state()
    # Every role left a mark on the index, so the comparison compares something.
    assert expected["first"]["pointer"][0] == 1
    assert expected["forward"]["pointer"][0] == 2
    assert expected["forward"]["served_acl"] == ["group:forward-v2"]
    assert expected["late"]["pointer"][0] == 2
    assert {row[0] for row in expected["late"]["chunks"]} == {1, 2}
    assert expected["newer_code_rerun"]["pointer"][1] == NEW.chunking_strategy
    assert await together.state() == expected
    assert await beside.state() == expected


async def test_a_lost_lease_in_a_group_written_together_writes_nothing_of_it(
    pool: asyncpg.Pool[Any],
) -> None:
    scenario = await scenario_for(pool, "acme")
    writes = scenario.final_writes()
    lost = writes[1].lease
    await pool.execute(
        "UPDATE index_task SET lease_owner = 'rescuer', attempts = attempts + 1 WHERE task_id = $1",
        lost.task_id,
    )
    before = await scenario.state()
    results = await asyncio.gather(
        *(scenario.queue.complete(write.lease, in_transaction=write) for write in writes),
        return_exceptions=True,
    )
    assert scenario.queue.completions.written_as_set == 1
    assert [isinstance(result, LeaseLost) for result in results] == [
        write.lease is lost for write in writes
    ]
    after = await scenario.state()
    lost_role = ROLES[1]
    assert after[lost_role] == before[lost_role]
    for role in ROLES:
        if role != lost_role:
            assert after[role] != before[role], role


async def test_a_failing_write_in_a_group_written_together_fails_its_task_only(
    pool: asyncpg.Pool[Any],
) -> None:
    scenario = await scenario_for(pool, "acme")
    writes = scenario.final_writes()
    text = INDEX_COLUMNS.index("text")
    broken = writes[2]
    # A chunk without text breaks the group's COPY: the group is written again task by
    # task, and only this task's write fails.
    broken.prepared = dataclasses.replace(
        broken.prepared,
        records=[(*record[:text], None, *record[text + 1 :]) for record in broken.prepared.records],
    )
    before = await scenario.state()
    results = await asyncio.gather(
        *(scenario.queue.complete(write.lease, in_transaction=write) for write in writes),
        return_exceptions=True,
    )
    assert scenario.queue.completions.written_as_set == 0  # the group's write failed
    assert [result is not None for result in results] == [write is broken for write in writes]
    after = await scenario.state()
    broken_role = ROLES[2]
    assert after[broken_role] == before[broken_role]
    for role in ROLES:
        if role != broken_role:
            assert after[role] != before[role], role


# What a completion of a document's first version sends besides its COPY, once the queue's
# and the sink's statements are warm: BEGIN, the fence, the generation's lock, the
# collector's mark with the pointer's lock and the write's statement timeout, the earlier
# set's delete, the generation's record, the first-pointer lock with the switch, the served
# ACL, the outbox's key locks with its rows, and COMMIT. Each is a round trip, and for a
# short document each costs the database more than its rows (BENCHMARKS.md, "Database CPU
# per document"): fifteen before they were merged.
FIRST_VERSION_STATEMENTS = 10


async def test_a_first_version_completes_in_its_budget_of_statements(
    settings: RuntimeSettings,
) -> None:
    sent: list[str] = []

    async def logged(conn: asyncpg.Connection[Any]) -> None:
        await _init_connection(conn)
        conn.add_query_logger(lambda record: sent.append(record.query))

    # The indexer's pool: its connections go back without a reset statement.
    pool = await create_pool_without_session_reset(settings, init=logged)
    try:
        scenario = await scenario_for(pool, "counted")
        [write, *_] = scenario.final_writes()
        assert write.lease == scenario.pending["first"]
        sent.clear()
        await scenario.queue.complete(write.lease, in_transaction=write)
        completion = list(sent)
        state = await scenario.state()
    finally:
        await pool.close()

    # It did all a first version's completion does: chunks, pointer, event, mark, task.
    assert state["first"]["pointer"][0] == 1
    assert len(state["first"]["chunks"]) == 2
    assert state["first"]["events"] == 1
    assert state["first"]["marked"] == 1
    assert state["first"]["tasks"] == ["SUCCEEDED"]
    # The first line of each statement after its comments: what it is, for the message.
    names = [next(line for line in s.splitlines() if not line.startswith("--")) for s in completion]
    assert len(completion) <= FIRST_VERSION_STATEMENTS, "\n".join(names)
