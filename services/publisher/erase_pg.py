"""The erase's content removal on PostgreSQL (docs/architecture.md#document-lifecycle):
bounded batches, each its own short transaction, as the tables' owner.

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
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any, Final

import asyncpg

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
from services.runtime.pg.sql import queries_beside

QUERIES = queries_beside(__file__, "erase.sql")

# What an erased document's title becomes (document.title is NOT NULL), and the title in
# its rewritten outbox events.
ERASED_TITLE: Final = "(erased)"

# The steps in order: (name, query). Each removes at most a batch per transaction.
_ROW_STEPS: Final = (
    ("staged_slices", "erase_staged_slices"),
    ("chunks", "erase_chunks"),
    ("version_content", "erase_version_content"),
    ("version_acl", "erase_version_acl"),
    ("task_messages", "erase_task_messages"),
    ("requeue_messages", "erase_requeue_messages"),
)

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

    def __init__(self, pool: asyncpg.Pool[Any], registry: SchemaRegistry | None = None) -> None:
        self._pool = pool
        self._registry = registry or default_registry()

    async def erase_content(
        self,
        tenant_id: str,
        document_id: uuid.UUID,
        *,
        batch_rows: int,
        now: datetime | None = None,
        between_batches: Callable[[str], Awaitable[None]] | None = None,
    ) -> datetime:
        removed: dict[str, int] = {}
        with translate_db_errors():
            async with self._pool.acquire() as conn:
                for step, query in _ROW_STEPS:
                    while True:
                        status = await conn.execute(
                            QUERIES[query], tenant_id, document_id, batch_rows
                        )
                        count = _affected(status)
                        removed[step] = removed.get(step, 0) + count
                        if between_batches is not None:
                            await between_batches(step)
                        if count < batch_rows:
                            break
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
        key = aggregate_key(tenant_id, document_id)
        after, rewritten = 0, 0
        while True:
            rows = await conn.fetch(
                QUERIES["outbox_rows_to_scrub"], key, list(_SCRUBBED_EVENTS), after, batch_rows
            )
            if not rows:
                return rewritten
            async with conn.transaction():
                for row in rows:
                    payload = bytes(row["payload"])
                    scrubbed = scrub_payload(self._registry, payload)
                    if scrubbed != payload:
                        await conn.execute(
                            QUERIES["rewrite_outbox_payload"], row["position"], scrubbed
                        )
                        rewritten += 1
            after = rows[-1]["position"]
            if between_batches is not None:
                await between_batches("outbox_rows")
