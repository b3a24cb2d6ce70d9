"""The erase's content removal on PostgreSQL (docs/architecture.md#document-lifecycle):
bounded batches, each its own short transaction, as the tables' owner. Shared by the
publisher's erase and `kb index check`, which reads with ``leftovers`` what a deleted or
erased document still holds, and with ``remove_deleted_leftovers`` / ``erase_content``
removes it by the same statements.

The publisher's transaction has already deleted the document (if it was live) and written
the audit row in progress (``start_erasure``). Here, step by step, each step repeated until
a batch removes nothing: the staged slices of its tasks, its chunks and embeddings (every
version, every generation), its versions' bytes, its versions' ACLs, its tasks' error
texts, the requeue audit's copies of them, and the titles and principals in its outbox
rows (rewritten in place: the relay never skips a row, see ``erase.sql``). The last
transaction replaces the title and sets ``erased_at``. Every step is idempotent, so a run
that stopped anywhere (a crash, a lost connection) is finished by running the erase again.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime
from typing import Any, Final, TypeAlias

import asyncpg

from services.runtime.erasure.leftovers import Leftovers
from services.runtime.logging import get_logger
from services.runtime.messaging.avro import (
    SchemaRegistry,
    default_registry,
    encode,
    payload_fingerprint,
)
from services.runtime.messaging.events import DOCUMENT_VERSION_PUBLISHED
from services.runtime.messaging.outbox import aggregate_key
from services.runtime.pg.db import translate_db_errors
from services.runtime.pg.records import from_row
from services.runtime.pg.sql import queries_beside

QUERIES = queries_beside(__file__, "erase.sql")

# What an erased document's title becomes (document.title is NOT NULL), and the title in
# its rewritten outbox events.
ERASED_TITLE: Final = "(erased)"

# The steps in order: (name, query). Each removes at most a batch per transaction. What no
# deleted document keeps (nothing serves it again), then what only the erase removes.
_DELETED_STEPS: Final = (
    ("staged_slices", "erase_staged_slices"),
    ("chunks", "erase_chunks"),
    ("served_acl", "erase_served_acl"),
)
_ROW_STEPS: Final = (
    *_DELETED_STEPS,
    ("version_content", "erase_version_content"),
    ("version_acl", "erase_version_acl"),
    ("task_messages", "erase_task_messages"),
    ("requeue_messages", "erase_requeue_messages"),
)

Step: TypeAlias = tuple[str, str]

# Events whose payload may carry content: a title and read principals.
_SCRUBBED_EVENTS: Final = (DOCUMENT_VERSION_PUBLISHED,)

log = get_logger(__name__)


def _affected(status: str) -> int:
    """The row count of a command tag ("DELETE 12", "UPDATE 3")."""
    return int(status.rsplit(" ", 1)[-1])


def scrub_payload(registry: SchemaRegistry, payload: bytes) -> bytes:
    """The event without its title and principals, encoded with the schema it was written
    with (same fingerprint: any consumer that could read it still can)."""
    decoded = registry.decode(payload, reader=registry.schema_for(payload_fingerprint(payload)))
    record = dict(decoded.record)
    if "title" in record:
        record["title"] = ERASED_TITLE
    if "readPrincipals" in record:
        record["readPrincipals"] = []
    return encode(decoded.writer, record)


class PgErasureStore:
    """:class:`services.publisher.ports.ErasureStore` on PostgreSQL. ``pool`` connects as
    the tables' owner: the batches run outside the tenant wall (they touch the staging
    table and the outbox, which the API's role may not write); every statement names the
    tenant and the document."""

    def __init__(
        self,
        pool: asyncpg.Pool[Any],
        registry: SchemaRegistry | None = None,
        *,
        between_batches: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        self._pool = pool
        self._registry = registry or default_registry()
        # Tests: awaited after each committed batch of an erase, with the step's name.
        self._between_batches = between_batches

    async def erase_content(
        self, tenant_id: str, document_id: uuid.UUID, *, batch_rows: int, now: datetime | None
    ) -> datetime:
        between_batches = self._between_batches
        with translate_db_errors():
            async with self._pool.acquire() as conn:
                removed = await _run_steps(
                    conn, _ROW_STEPS, tenant_id, document_id, batch_rows, between_batches
                )
                removed["outbox_rows"] = await self._scrub_outbox(
                    conn, tenant_id, document_id, batch_rows, between_batches
                )
                erased_at: datetime | None = await conn.fetchval(
                    QUERIES["finish_erasure"], tenant_id, document_id, ERASED_TITLE, now
                )
        if erased_at is None:
            raise AssertionError("the erase ran without its audit row")  # start_erasure wrote it
        log.info(
            "document.erase_finished",
            tenant_id=tenant_id,
            document_id=str(document_id),
            **removed,
        )
        return erased_at

    async def _scrub_outbox(
        self,
        conn: Any,
        tenant_id: str,
        document_id: uuid.UUID,
        batch_rows: int,
        between_batches: Callable[[str], Awaitable[None]] | None,
    ) -> int:
        rewritten = 0
        async for rows in _outbox_batches(conn, tenant_id, document_id, batch_rows):
            async with conn.transaction():
                for row in rows:
                    payload = bytes(row["payload"])
                    scrubbed = scrub_payload(self._registry, payload)
                    if scrubbed != payload:
                        await conn.execute(
                            QUERIES["rewrite_outbox_payload"], row["position"], scrubbed
                        )
                        rewritten += 1
            if between_batches is not None:
                await between_batches("outbox_rows")
        return rewritten

    async def remove_deleted_leftovers(
        self,
        tenant_id: str,
        document_id: uuid.UUID,
        *,
        batch_rows: int,
        now: datetime | None = None,
    ) -> dict[str, int]:
        """What a deleted document may not keep, gone: its pointer made its tombstone (first:
        from then on nothing of it is served), then its staged slices, chunks and served ACL
        rows in batches. Every statement is fenced by the document's ``deleted_at``: a live
        document is never touched. Idempotent; how many rows each step changed."""
        with translate_db_errors():
            async with self._pool.acquire() as conn:
                status = await conn.execute(
                    QUERIES["tombstone_deleted_pointer"], tenant_id, document_id, now
                )
                removed = {"pointer": _affected(status)}
                removed |= await _run_steps(
                    conn, _DELETED_STEPS, tenant_id, document_id, batch_rows, None
                )
        return removed

    async def leftovers(self, tenant_id: str | None, *, batch_rows: int) -> list[Leftovers]:
        """Every deleted document (of ``tenant_id``, or of every tenant) that still holds
        anything it may not, with counts; one snapshot for the rows, then, for each document
        whose erase was asked for, its outbox events still carrying a title or principals."""
        with translate_db_errors():
            async with self._pool.acquire() as conn:
                rows = await conn.fetch(
                    QUERIES["deleted_document_leftovers"], tenant_id, ERASED_TITLE
                )
                found = []
                for row in rows:
                    outbox = 0
                    if row["erase_requested_at"] is not None:
                        outbox = await self._unscrubbed(
                            conn, row["tenant_id"], row["document_id"], batch_rows
                        )
                    found.append(from_row(Leftovers, row, outbox_events=outbox))
        return found

    async def _unscrubbed(
        self, conn: Any, tenant_id: str, document_id: uuid.UUID, batch_rows: int
    ) -> int:
        count = 0
        async for rows in _outbox_batches(conn, tenant_id, document_id, batch_rows):
            count += sum(
                scrub_payload(self._registry, bytes(row["payload"])) != bytes(row["payload"])
                for row in rows
            )
        return count


async def _run_steps(
    conn: Any,
    steps: tuple[Step, ...],
    tenant_id: str,
    document_id: uuid.UUID,
    batch_rows: int,
    between_batches: Callable[[str], Awaitable[None]] | None,
) -> dict[str, int]:
    """Each step's batches until one sees nothing of the step left; rows per step. What a
    batch removed is no sign of the end: rows another session (the collector) deleted while
    the batch waited on their locks are skipped, not counted, and the rows past the batch
    are still there, even when the batch removed none."""
    removed: dict[str, int] = {}
    for step, query in steps:
        while True:
            batch = await conn.fetchrow(QUERIES[query], tenant_id, document_id, batch_rows)
            removed[step] = removed.get(step, 0) + batch["removed"]
            if between_batches is not None:
                await between_batches(step)
            if batch["seen"] == 0:
                break
    return removed


async def _outbox_batches(
    conn: Any, tenant_id: str, document_id: uuid.UUID, batch_rows: int
) -> AsyncIterator[list[Any]]:
    """The document's outbox rows whose events may carry content, a batch at a time, in
    position order (a cursor, so rows rewritten meanwhile are not read twice)."""
    key = aggregate_key(tenant_id, document_id)
    after = 0
    while True:
        rows = await conn.fetch(
            QUERIES["outbox_rows_to_scrub"], key, list(_SCRUBBED_EVENTS), after, batch_rows
        )
        if not rows:
            return
        yield rows
        after = rows[-1]["position"]
