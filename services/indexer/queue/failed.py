"""The ``DocumentIndexingFailed`` event: a task that ends DEAD says so in the transaction
that buries it (docs/architecture.md#events), so a producer that published the version
learns it failed for good without polling.

Both ways the queue buries a task write it: the fenced ``fail_task`` (a terminal code, a
spent budget) and the claim's burial of an exhausted lease (``claim_tasks``). Each returns
the rows it ended with their command id (the ingest command that created the task, if
any). A row ended by its document's delete (``DOCUMENT_DELETED``) gets none: the delete's
``DocumentDeleted`` answers for every task it ended, and a later attempt refused by the
tombstone is the same ending seen late.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from services.runtime.indexing.index_failures import ErrorCode
from services.runtime.messaging.avro import SchemaRegistry
from services.runtime.messaging.events import DOCUMENT_INDEXING_FAILED, event_id
from services.runtime.messaging.outbox import OutboxEvent, add_events, aggregate_key
from services.runtime.pg.transaction import Transaction


def failed_event_id(task_id: uuid.UUID, attempts: int) -> uuid.UUID:
    """One id per ending: a task requeued and buried again ends under a later attempt
    (the generation never repeats), a retried transaction writes the same id."""
    return event_id(DOCUMENT_INDEXING_FAILED, task_id, attempts)


def failed_event(
    registry: SchemaRegistry, row: Mapping[str, Any], *, row_trace: bool
) -> OutboxEvent:
    """The event of a buried task's row (an ``index_task`` row plus ``command_id``). The
    error message stays in the row: it may quote content, the code is the contract.
    ``row_trace``: continue the publish's trace stored with the row (a claim burying a
    lease, no attempt of its own running); otherwise the current span, the failing
    attempt's."""
    id_ = failed_event_id(row["task_id"], row["attempts"])
    payload = registry.encode(
        DOCUMENT_INDEXING_FAILED,
        {
            "eventId": str(id_),
            "tenantId": row["tenant_id"],
            "tier": row["tier"],
            "documentId": str(row["document_id"]),
            "versionNumber": row["version_number"],
            "taskId": str(row["task_id"]),
            "errorCode": row["error_code"],
            "commandId": row["command_id"],
            "occurredAt": row["finished_at"],
        },
    )
    return OutboxEvent(
        event_type=DOCUMENT_INDEXING_FAILED,
        tenant_id=row["tenant_id"],
        tier=row["tier"],
        aggregate_key=aggregate_key(row["tenant_id"], row["document_id"]),
        payload=payload,
        event_id=id_,
        traceparent=row["traceparent"] if row_trace else None,
    )


def announced(row: Mapping[str, Any]) -> bool:
    return bool(row["status"] == "DEAD" and row["error_code"] != ErrorCode.DOCUMENT_DELETED)


async def announce_dead(
    conn: Transaction,
    rows: Sequence[Mapping[str, Any]],
    registry: SchemaRegistry,
    *,
    row_trace: bool,
) -> None:
    """Adds the event of every row of ``rows`` that ended DEAD, in the transaction that
    ended it."""
    events = [failed_event(registry, row, row_trace=row_trace) for row in rows if announced(row)]
    await add_events(conn, events)
