"""`kb index generations retire G`: a generation no tenant is served by goes.

One transaction stops building it (state RETIRING, its tenant rows -- so publishes stop
indexing into it -- and its unfinished tasks, ended DEAD); then its chunks, document rows
and tasks are deleted in bounded batches, each a transaction of its own; then its model's
indexes are dropped if nothing else uses the model, and it is marked RETIRED. Run again
after a crash, it goes on from RETIRING.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import KW_ONLY, dataclass
from datetime import datetime
from typing import Any, Final

import asyncpg

from services.index.ann import ann_index_name
from services.index.generations import SearchGeneration
from services.indexer.generations.model import (
    GENERATION_RETIRED,
    MISSING_SHOWN,
    RETIRE_BATCH,
    RetireOutcome,
)
from services.indexer.generations.queries import QUERIES, rows_of
from services.indexer.sink.pgvector import PartitionedDrop
from services.runtime.errors import BadInput, NotFound
from services.runtime.logging import get_logger
from services.runtime.pg.db import translate_db_errors

log = get_logger(__name__)

# Index names read from the catalog before they go into DROP INDEX: the model's ANN index
# and the tenant graphs named after it (services.index.ann), nothing else.
_OUR_INDEX: Final = re.compile(r"^knowledge_chunk_ann_[0-9a-f]{16}(_t[0-9a-f]{16})?$")
# A strategy id that records no chunk settings: nothing to tell its chunks apart by.
_NO_SETTINGS: Final = ""


@dataclass(frozen=True)
class PgRetirement:
    pool: asyncpg.Pool[Any]
    _: KW_ONLY
    now: datetime | None = None
    batch_size: int = RETIRE_BATCH
    lock_timeout: str = "2s"
    drop_attempts: int = 5
    drop_pause_seconds: float = 1.0
    # Called after each batch with its step's name ("chunks", "documents", "tasks"): the
    # tests' way in between two batches, to race them with another remover.
    between_batches: Callable[[str], Awaitable[None]] | None = None

    async def retire(self, generation_id: int) -> RetireOutcome:
        """Refuses the default and a generation any tenant serves; otherwise stops building
        it (its tenant rows and unfinished tasks go in one transaction), then deletes its
        chunks, its document rows and its tasks in batches, drops its model's indexes if no
        one else uses the model, and marks it RETIRED."""
        with translate_db_errors():
            async with self.pool.acquire() as conn, conn.transaction():
                # Lock order, the same as every other writer's: the task rows (in the one
                # order of complete_task), the tenant rows, then the generation's row. A
                # completion holds its task rows, then its tenant's rows and the
                # generation's row FOR SHARE; a switch its tenant's rows, then the
                # generation's row FOR SHARE. Taking the tenant rows before the task rows
                # would wait for a committing backfill while it waits for us (a deadlock),
                # and the generation's row first for any of them.
                await conn.fetchval(QUERIES["lock_generations"])
                row = await conn.fetchrow(QUERIES["read_generation"], generation_id)
                if row is None:
                    raise NotFound(f"no generation {generation_id}", code="GENERATION_NOT_FOUND")
                # Stable under lock_generations: only a retire changes the state, and only an
                # indexer's registration of the default (under the same lock) the flag.
                generation = SearchGeneration.from_record(row)
                if generation.state == "RETIRED":
                    return RetireOutcome(generation_id, already_retired=True)
                if generation.is_default:
                    raise BadInput(
                        f"{generation.describe()} is the default (the indexers' KB_EMBEDDING_*): "
                        "it serves every tenant without a generation of its own"
                    )
                await conn.fetchval(QUERIES["lock_unfinished_tasks"], generation_id)
                tenants = await conn.fetch(QUERIES["serving_rows_of_generation"], generation_id)
                serving = [r["tenant_id"] for r in tenants if r["serving"]]
                if serving:
                    raise BadInput(
                        f"{generation.describe()} serves {len(serving)} tenants ("
                        + ", ".join(serving[:MISSING_SHOWN])
                        + "): switch them to another generation first"
                    )
                ended = await conn.execute(
                    QUERIES["end_unfinished_tasks"],
                    generation_id,
                    GENERATION_RETIRED,
                    f"generation {generation_id} was retired",
                    self.now,
                )
                await conn.execute(QUERIES["start_retiring"], generation_id)
                await conn.execute(QUERIES["delete_tenant_rows"], generation_id)
        log.info("generation.retiring", generation_id=generation_id, tasks_ended=rows_of(ended))
        chunks = await self._delete_chunks(generation)
        documents = await self._batches(
            "documents",
            _statement(QUERIES["delete_document_versions_batch"], generation_id, self.batch_size),
        )
        tasks = await self._batches(
            "tasks", _statement(QUERIES["delete_task_batch"], generation_id, self.batch_size)
        )
        dropped = await self._drop_indexes(generation)
        with translate_db_errors():
            await self.pool.execute(QUERIES["finish_retiring"], generation_id, self.now)
        outcome = RetireOutcome(
            generation_id, False, rows_of(ended), chunks, documents, tasks, dropped
        )
        log.info(
            "generation.retired",
            generation_id=generation_id,
            chunks_deleted=chunks,
            document_rows_deleted=documents,
            tasks_deleted=tasks,
            indexes_dropped=len(dropped),
        )
        return outcome

    async def _delete_chunks(self, generation: SearchGeneration) -> int:
        generation_id, model = generation.generation_id, generation.embedding_model
        with translate_db_errors():
            settings = (
                {generation.chunking_settings}
                if generation.chunking_settings
                else {
                    r["settings"]
                    for r in await self.pool.fetch(
                        QUERIES["generation_chunk_settings"], generation_id
                    )
                }
            )
            tenants = [
                r["tenant_id"] for r in await self.pool.fetch(QUERIES["tenants_with_chunks"])
            ]
        deleted = 0
        for chunk_settings in sorted(settings - {_NO_SETTINGS}):
            if await self.pool.fetchval(
                QUERIES["shared_chunk_settings"], generation_id, model, chunk_settings
            ):
                log.warning(
                    "generation.chunks_kept",
                    generation_id=generation_id,
                    reason="another generation has the same model and chunk settings",
                )
                continue
            for tenant in tenants:
                deleted += await self._batches(
                    "chunks",
                    _statement(
                        QUERIES["delete_chunk_batch"],
                        tenant,
                        model,
                        chunk_settings,
                        self.batch_size,
                    ),
                )
        return deleted

    async def _batches(self, name: str, step: Callable[[Any], Awaitable[Any]]) -> int:
        """Runs ``step`` (one bounded DELETE) in transactions of its own until a batch sees
        nothing of the step left; the rows this retire deleted in all. What a batch removed
        is no sign of the end: rows another session (a second retire, the collector, a
        document erase) deleted while the batch waited on their locks are skipped, not
        counted, and the rows past the batch are still there, even when it removed none."""
        total = 0
        while True:
            with translate_db_errors():
                async with self.pool.acquire() as conn, conn.transaction():
                    batch = await step(conn)
            total += int(batch["removed"])
            if self.between_batches is not None:
                await self.between_batches(name)
            if batch["seen"] == 0:
                return total

    async def _drop_indexes(self, generation: SearchGeneration) -> list[str]:
        """The model's ANN index and tenant graphs, unless another live generation embeds
        with the model or a pointer still names it."""
        model = generation.embedding_model
        with translate_db_errors():
            if await self.pool.fetchval(
                QUERIES["model_still_used"], generation.generation_id, model
            ):
                return []
            rows = await self.pool.fetch(QUERIES["model_indexes"], ann_index_name(model))
            dropped = []
            async with self.pool.acquire() as conn:
                # Tenant graphs first, without blocking writes; the partitioned index last
                # (it cannot be dropped concurrently, and takes its partitions' parts along).
                for row in rows:
                    name = row["index_name"]
                    if not _OUR_INDEX.match(name):
                        continue
                    if row["partitioned"]:  # the model's own (ann_index_name)
                        await self._drop_partitioned(conn, model)
                    else:
                        await conn.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {name}")
                    dropped.append(name)
        return dropped

    async def _drop_partitioned(self, conn: Any, model: str) -> None:
        """A few tries, each within a short lock_timeout (pgvector.PartitionedDrop); after
        the last, DatabaseBusy (exit 1), the generation stays RETIRING and a second run of
        the command tries again (its deletes find nothing left)."""
        drop = PartitionedDrop(self.lock_timeout, self.drop_attempts, self.drop_pause_seconds)
        await drop.run(conn, model, again="kb index generations retire")


def _statement(sql: str, *args: Any) -> Callable[[Any], Awaitable[Any]]:
    """One batch statement with its arguments, to run on the connection it is given: its
    row of ``removed`` and ``seen``."""

    def run(conn: Any) -> Awaitable[Any]:
        result: Awaitable[Any] = conn.fetchrow(sql, *args)
        return result

    return run
