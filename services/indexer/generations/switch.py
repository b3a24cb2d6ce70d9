"""`kb index generations switch`: a tenant's search moved to another generation in one
transaction (generations.sql: lock_tenant_generations says how it excludes completions)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import asyncpg

from services.indexer.generations.model import (
    MISSING_SHOWN,
    MissingDocument,
    SwitchOutcome,
    SwitchRefused,
)
from services.indexer.generations.queries import QUERIES, default_generation, find_generation
from services.runtime.errors import BadInput, NotFound
from services.runtime.logging import get_logger
from services.runtime.pg.db import translate_db_errors
from services.runtime.tenancy.served_acl import apply_served_acl, lock_first_pointer

log = get_logger(__name__)


class PgSwitch:
    def __init__(self, pool: asyncpg.Pool[Any], *, now: datetime | None = None) -> None:
        self._pool = pool
        self._now = now  # tests pin the clock; otherwise the database's

    async def switch(self, tenant_id: str, generation_id: int, *, force: bool) -> SwitchOutcome:
        """Moves the tenant's search to the generation in one transaction: every pointer
        rewritten to what it holds, its row serving. Refused (SwitchRefused, nothing
        changed) when it lacks a served version, unless ``force``: those pointers go."""
        with translate_db_errors():
            async with self._pool.acquire() as conn, conn.transaction():
                if not await conn.fetchval(QUERIES["tenant_exists"], tenant_id):
                    raise NotFound(f"no tenant {tenant_id!r}", code="TENANT_NOT_FOUND")
                # The tenant's rows first, then the generation's: the order completions and
                # retire take them in (generations.sql: lock_tenant_generations).
                rows = await conn.fetch(QUERIES["lock_tenant_generations"], tenant_id)
                target = await find_generation(conn, generation_id)
                if not target.active:
                    raise BadInput(f"{target.describe()} is {target.state}: it serves no one")
                serving = [r["generation_id"] for r in rows if r["serving"]]
                previous = (
                    serving[0]
                    if serving
                    else (await default_generation(conn, built=False)).generation_id
                )
                if previous == generation_id:
                    return SwitchOutcome(tenant_id, previous, generation_id, 0, switched=False)
                if generation_id not in {r["generation_id"] for r in rows}:
                    raise BadInput(
                        f"tenant {tenant_id} is not built in generation {generation_id}: "
                        f"`kb index generations create ... --tenant {tenant_id}` first"
                    )
                missing, total = await _missing(conn, tenant_id, generation_id)
                if total and not force:
                    raise SwitchRefused(tenant_id, generation_id, missing, total)
                if total:
                    await conn.execute(QUERIES["drop_missing_pointers"], tenant_id, generation_id)
                rewritten = await conn.fetchrow(
                    QUERIES["rewrite_pointers"],
                    tenant_id,
                    generation_id,
                    target.embedding_model,
                    self._now,
                )
                assert rewritten is not None  # an aggregate: always one row
                first_served = await conn.fetchval(
                    QUERIES["serve_documents_only_the_target_holds"],
                    tenant_id,
                    generation_id,
                    target.embedding_model,
                    self._now,
                )
                # Pointers moved to newer versions (or given one) serve those versions' ACLs
                # from this commit on, as a completion's switch does (issue 29, item 1). This
                # transaction holds their pointer rows: a publish of one of them waits for it.
                # The new pointers' stand-in locks first (served_acl.sql: lock_first_pointer):
                # a publish of one of them that saw no pointer then commits before the ACL is
                # read, or waits for this commit and applies its ACL itself.
                await lock_first_pointer(conn, tenant_id, first_served)
                await apply_served_acl(conn, tenant_id, [*rewritten["moved"], *first_served])
                await conn.execute(QUERIES["stop_serving"], tenant_id)
                await conn.execute(QUERIES["start_serving"], tenant_id, generation_id, self._now)
        outcome = SwitchOutcome(
            tenant_id, previous, generation_id, rewritten["rewritten"], missing, total
        )
        log.info(
            "generation.switched",
            tenant_id=tenant_id,
            generation_id=generation_id,
            previous_generation_id=previous,
            pointers_rewritten=outcome.rewritten,
            pointers_dropped=total,
        )
        return outcome


async def _missing(
    conn: Any, tenant_id: str, generation_id: int
) -> tuple[list[MissingDocument], int]:
    rows = await conn.fetch(QUERIES["missing_documents"], tenant_id, generation_id, MISSING_SHOWN)
    if not rows:
        return [], 0
    total = await conn.fetchval(QUERIES["count_missing_documents"], tenant_id, generation_id)
    return [
        MissingDocument(r["document_id"], r["served_version"], r["built_version"]) for r in rows
    ], int(total)
