"""The outbox writer: any producer adds an event inside its own transaction.

The event is committed or rolled back together with the business change it announces;
the relay (services/relay) later carries committed rows to Kafka. The body is already
encoded (Avro single-object encoding, see ``schemas/``) so the relay never needs to
understand it.

Per-document order is the writer's guarantee, not a convention callers must keep:
``add_event`` serialises the transactions writing one aggregate key (a transaction-scoped
advisory lock, see ``outbox.sql``), so their events' positions follow their commits. A
transaction adding events for several keys should add them in a stable order (as every
lock taker should), or two such transactions may deadlock (reported as retriable).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from services.runtime.pg.db import translate_db_errors
from services.runtime.pg.sql import queries_beside
from services.runtime.pg.transaction import Transaction
from services.runtime.tracing.propagation import current_traceparent

_QUERIES = queries_beside(__file__, "outbox.sql")


def aggregate_key(tenant_id: str, document_id: uuid.UUID | str) -> str:
    """The Kafka key: every event of one document goes to one partition, in order."""
    return f"{tenant_id}/{document_id}"


@dataclass(frozen=True)
class OutboxEvent:
    event_type: str
    tenant_id: str
    tier: str
    aggregate_key: str
    payload: bytes
    # Stable across retries of the same business change: consumers deduplicate on it.
    event_id: uuid.UUID = field(default_factory=uuid.uuid4)
    # The W3C trace context the relay continues (services/runtime/tracing); None: the
    # writer's current span, if it has one (traceparent_of_event).
    traceparent: str | None = None


def traceparent_of_event(event: OutboxEvent) -> str | None:
    """The trace an event's delivery continues: its own, else the writing transaction's
    current span (a publish request's)."""
    return event.traceparent if event.traceparent is not None else current_traceparent()


@dataclass(frozen=True)
class StoredEvent:
    position: int
    event_id: uuid.UUID


async def add_event(conn: Transaction, event: OutboxEvent) -> StoredEvent:
    """Insert ``event`` in the caller's transaction (which must be open), after waiting for
    any other open transaction that wrote an event with the same aggregate key."""
    if not conn.is_in_transaction():
        raise RuntimeError("add_event must run inside the producer's transaction")
    with translate_db_errors():
        row = await conn.fetchrow(
            _QUERIES["insert_event"],
            event.event_id,
            event.event_type,
            event.tenant_id,
            event.tier,
            event.aggregate_key,
            event.payload,
            traceparent_of_event(event),
        )
    assert row is not None
    return StoredEvent(position=row["position"], event_id=row["event_id"])


async def add_events(conn: Transaction, events: Sequence[OutboxEvent]) -> list[StoredEvent]:
    """``add_event`` for several events in one statement: every aggregate key's lock, in key
    order (a stable order, as the module says), then the rows, positioned in the order
    given."""
    if not conn.is_in_transaction():
        raise RuntimeError("add_events must run inside the producer's transaction")
    return await _insert_events(conn, events, lock_keys=True)


async def add_events_of_new_aggregates(
    conn: Transaction, events: Sequence[OutboxEvent]
) -> list[StoredEvent]:
    """``add_events`` without the per-key locks, for aggregates created in this very
    transaction (a bulk publish's new documents): no other transaction can add an event
    for them, so positions follow the order given and commit order alike."""
    return await _insert_events(conn, events, lock_keys=False)


async def _insert_events(
    conn: Transaction, events: Sequence[OutboxEvent], *, lock_keys: bool
) -> list[StoredEvent]:
    if not events:
        return []
    with translate_db_errors():
        rows = await conn.fetch(
            _QUERIES["insert_events"],
            [event.event_id for event in events],
            [event.event_type for event in events],
            [event.tenant_id for event in events],
            [event.tier for event in events],
            [event.aggregate_key for event in events],
            [event.payload for event in events],
            [traceparent_of_event(event) for event in events],
            lock_keys,
        )
    return [StoredEvent(position=row["position"], event_id=row["event_id"]) for row in rows]
