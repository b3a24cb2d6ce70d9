"""The sink's write of completed versions, one or many (a group of completions,
services/indexer/queue/completions.py), in one set of statements.

A completion is a dozen small statements (its generation, the collector's mark, the
pointer's lock, the earlier set's delete, the COPY, the generation's record, the switch, the
served ACL, the outbox event), and each costs a round trip and the server's per-statement
work: for a short document more than the rows themselves (BENCHMARKS.md, issue 26). Here
each of those statements (sink.sql, generations.sql, gc.sql) runs once for all the versions
written, one array element each: a completion alone sends one element, a group one per
version. And where one statement's locks must come before the next one's, the two go as
one, the first as a CTE that a one-time filter of the second reads before its first row
(the mark with the pointer's lock and the write's statement timeout, the first-pointer lock
with the switch; the outbox's key locks with its rows, outbox.sql): fewer round trips, the
same locks in the same order (BENCHMARKS.md, "Database CPU per document"). A large
document's chunks, staged slice by slice (stream.py), are moved in from the staging table
instead of COPYed.

The group's fences are checked before (the queue's ``complete_task``, for all of them); a
lost lease's write is not among ``writes``. A failing statement fails the group's
transaction: the queue then writes each task on its own, in a savepoint, so the failure
stays with its task.

Lock order. A group holds at most one write per document. Each statement takes its rows in
(tenant, document) order, and the statements come in the order above (generation rows, the
marks, the pointers, the first-pointer locks, the ACL rows, the outbox keys); only the
deletes of earlier chunk sets go a tenant at a time, which locks nothing another group of
the document could hold (its pointer is locked by then). A publish takes a document's locks
in that same order, and no one holds a later kind of lock of a document while waiting for
an earlier kind of another one that a group could hold: groups and publishes wait for each
other but never in a cycle.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from itertools import chain
from typing import Any

from services.indexer.sink.generations import (
    CompletionTarget,
    TargetKey,
    discard_task_stream,
    lock_targets,
    record_versions,
)
from services.indexer.sink.stream import move_staged
from services.indexer.sink.version import ServedPointer, not_switched_reason, replaced_strategy
from services.indexer.sink.write import (
    INDEX_COLUMNS,
    INDEX_TABLE,
    ChunkWrite,
    log,
    log_replaced,
    switched_event,
)
from services.indexer.task import ErrorCode, IndexingFailed, Lease
from services.runtime.messaging.avro import SchemaRegistry
from services.runtime.messaging.outbox import add_events
from services.runtime.pg.db import translate_db_errors
from services.runtime.pg.records import from_row
from services.runtime.pg.sql import queries_beside
from services.runtime.pg.transaction import Transaction
from services.runtime.tenancy.served_acl import TenantDocument, apply_served_acls
from services.runtime.tracing.spans import SpansUnder, link_here

QUERIES = queries_beside(__file__, "sink.sql")


@dataclass(frozen=True)
class _Placed:
    """One write of the group with what its statements decided for it."""

    write: ChunkWrite
    target: CompletionTarget | None
    served: ServedPointer | None = None

    @property
    def key(self) -> TenantDocument:
        return (self.write.lease.tenant_id, self.write.lease.document_id)

    @property
    def switches(self) -> bool:
        """Whether the pointer may move to it: its generation serves the tenant (or none is
        known, as before generations)."""
        return self.target is None or self.target.serving


async def write_together(
    conn: Transaction,
    writes: Sequence[ChunkWrite],
    *,
    registry: SchemaRegistry,
    now: datetime | None,
    timeout_ms: Callable[[int], int],
) -> None:
    """Writes ``writes`` (one per document; their fences held) in ``conn``'s transaction."""
    ordered = sorted(writes, key=lambda w: (w.lease.tenant_id, w.lease.document_id))
    if len({(w.lease.tenant_id, w.lease.document_id) for w in ordered}) != len(ordered):
        raise ValueError("a group written together holds one write per document")
    placed = []
    for p in await _targets(conn, ordered):
        if p.target is None or p.target.write:
            placed.append(p)
        elif p.write.staged is not None:
            # Its generation is being retired: nothing is written, its staged slices go.
            await discard_task_stream(conn, p.write.lease)
    if not placed:
        return
    documents = [p.key for p in placed]
    with translate_db_errors():
        # The collector's marks, then the pointers' locks, and the write's statement timeout
        # (for what follows: the rows' inserts take time by the chunk) set (sink.sql).
        rows = await conn.fetch(
            QUERIES["lock_search_pointer"],
            [tenant_id for tenant_id, _ in documents],
            [document_id for _, document_id in documents],
            now,
            str(timeout_ms(sum(p.write.chunk_count for p in placed))),
        )
    pointers = {
        (row["tenant_id"], row["document_id"]): from_row(ServedPointer, row) for row in rows
    }
    placed = [_Placed(p.write, p.target, pointers.get(p.key)) for p in placed]
    _refuse_deleted(placed)
    await _replace_chunks(conn, placed)
    await record_versions(
        conn,
        [
            (p.write.lease, p.target.generation_id, p.write.generation, p.write.chunk_count)
            for p in placed
            if p.target is not None
        ],
        now,
    )
    await _switch(conn, [p for p in placed if p.switches], registry, now)


def _refuse_deleted(placed: list[_Placed]) -> None:
    """The tombstone fences a completion as a lease does (docs/architecture.md#document-
    lifecycle): a write whose document was deleted writes nothing -- no chunk, no
    generation record, no pointer, no event -- and its task ends DEAD with
    DOCUMENT_DELETED (a terminal code: no retry). The delete ended the tasks it found, so
    this is the wall for a task run after it: an operator's requeue, a repair's re-run, a
    backfill. Raised before the first write: the group's transaction rolls back and the
    queue writes each task on its own (completions.py), so the failure stays with its task.
    Every generation's write is refused, not only the serving one's: a deleted document is
    built into none."""
    for p in placed:
        if p.served is not None and p.served.deleted_at is not None:
            lease = p.write.lease
            log.info("completion.refused_deleted", **lease.log_fields())
            raise IndexingFailed(
                ErrorCode.DOCUMENT_DELETED,
                f"document {lease.document_id} was deleted at {p.served.deleted_at.isoformat()}; "
                "its completion writes nothing",
            )


async def _targets(conn: Transaction, writes: list[ChunkWrite]) -> list[_Placed]:
    """Each write's target, its generation's rows locked once per (tenant, generation,
    named)."""
    shared: dict[TargetKey, list[Lease]] = defaultdict(list)
    for write in writes:
        if write.search_generation_id is not None:
            shared[_target_key(write)].append(write.lease)
    targets = await lock_targets(conn, shared) if shared else {}
    return [
        _Placed(write, None if write.search_generation_id is None else targets[_target_key(write)])
        for write in writes
    ]


def _target_key(write: ChunkWrite) -> TargetKey:
    assert write.search_generation_id is not None
    lease = write.lease
    return (lease.tenant_id, write.search_generation_id, lease.generation_id is not None)


async def _replace_chunks(conn: Transaction, placed: list[_Placed]) -> None:
    """Each version's earlier set deleted and its new one written (sink.sql:
    replace_version_chunks says why): for the chunks held in memory, a delete per tenant
    and one COPY for all; a staged document's are moved in from the staging table."""
    replaced = [replaced_strategy(p.served, p.write.lease, p.write.generation) for p in placed]
    deleted: Counter[TenantDocument] = Counter()
    by_tenant: dict[str, list[int]] = defaultdict(list)
    for at, p in enumerate(placed):
        if p.write.staged is None:
            by_tenant[p.write.lease.tenant_id].append(at)
    with translate_db_errors():
        for tenant_id, ats in by_tenant.items():
            rows = await conn.fetch(
                QUERIES["replace_version_chunks"],
                tenant_id,
                [placed[at].write.lease.document_id for at in ats],
                [placed[at].write.lease.version_number for at in ats],
                [placed[at].write.generation.embedding_model for at in ats],
                [placed[at].write.generation.chunking_strategy for at in ats],
                [replaced[at] for at in ats],
            )
            deleted.update((tenant_id, row["document_id"]) for row in rows)
        records = list(chain.from_iterable(p.write.records for p in placed))
        if records:
            await conn.copy_records_to_table(INDEX_TABLE, records=records, columns=INDEX_COLUMNS)
    for p, strategy in zip(placed, replaced, strict=True):
        write = p.write
        if write.staged is not None:
            status = await move_staged(conn, write.lease, write.generation, write.staged, strategy)
            deleted[p.key] = int(status.rsplit(" ", 1)[-1])  # "DELETE <rows>"
        log_replaced(
            write.lease, write.generation, p.served, strategy, deleted[p.key], write.chunk_count
        )


async def _switch(
    conn: Transaction,
    placed: list[_Placed],
    registry: SchemaRegistry,
    now: datetime | None,
) -> None:
    """The forward-only pointer switches (or, at the served version, a rewrite to the chunk
    set just written), the served ACL of every document whose pointer moved, and one event
    per changed pointer."""
    if not placed:
        return
    # A span in each document's trace, linked to the group commit's span (the current
    # one: queue/completions.py); its event continues from it.
    spans = SpansUnder(
        "kb.index.switch",
        [p.write.lease.traceparent for p in placed],
        {"db.system.name": "postgresql", "db.operation.name": "UPDATE"},
        links=link_here(),
    )
    try:
        switched = await _switch_pointers(conn, placed, registry, now, spans)
    except BaseException as error:
        spans.end([error] * len(placed))
        raise
    spans.end(attributes=[{"kb.switched": p.key in switched} for p in placed])


async def _switch_pointers(
    conn: Transaction,
    placed: list[_Placed],
    registry: SchemaRegistry,
    now: datetime | None,
    spans: SpansUnder,
) -> set[TenantDocument]:
    """``_switch`` under its spans: the documents whose pointer switched."""
    switched: dict[TenantDocument, Any] = {}
    for replaces in (False, True):
        batch = [
            p
            for p in placed
            if (p.served is not None and p.served.replaces(p.write.lease, p.write.generation))
            is replaces
        ]
        if not batch:
            continue
        # A document's first pointer: no row was locked, so a publish of its ACL would not
        # wait for this switch; the statement first takes the lock that stands in for the row
        # (served_acl.sql: lock_first_pointer).
        first = [p.key for p in batch if p.served is None]
        with translate_db_errors():
            rows = await conn.fetch(
                QUERIES["switch_search_version"],
                [tenant_id for tenant_id, _ in first],
                [document_id for _, document_id in first],
                [p.write.lease.tenant_id for p in batch],
                [p.write.lease.document_id for p in batch],
                [p.write.lease.version_number for p in batch],
                [p.write.generation.embedding_model for p in batch],
                [p.write.generation.chunking_strategy for p in batch],
                [p.write.chunk_count for p in batch],
                [p.write.lease.task_id for p in batch],
                now,
                replaces,
            )
        switched.update(((row["tenant_id"], row["document_id"]), row) for row in rows)
    moved: list[TenantDocument] = []
    events = []
    for at, p in enumerate(placed):
        lease, generation = p.write.lease, p.write.generation
        row = switched.get(p.key)
        if row is None:
            log.info(
                "search_version.not_switched",
                **lease.log_fields(),
                reason=not_switched_reason(p.served, lease, generation),
            )
            continue
        if row["previous_version"] != lease.version_number:
            moved.append(p.key)
        event = switched_event(registry, lease, generation, p.write.chunk_count, row)
        # The event continues the document's trace from its switch's span.
        events.append(replace(event, traceparent=spans.traceparent(at) or lease.traceparent))
    # The pointer moved to these versions (or is the document's first): the ACL each was
    # published with becomes the one search applies, in this transaction (issue 29, item
    # 1); a rewrite at the same version keeps the served ACL. Lock order: the pointer rows
    # (held since lock_search_pointer), then the ACL rows, as a publish takes them after the
    # document row; a completion only takes FOR KEY SHARE on that row (foreign key checks),
    # which the publish's lock does not block (services/publisher/queries.sql:
    # lock_document, lock_search_pointer).
    await apply_served_acls(conn, moved)
    await add_events(conn, events)
    return set(switched)
