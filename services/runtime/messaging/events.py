"""The event vocabulary every service shares: event type names, stable event ids, topics.

The publisher and the indexer's sink write these events to the outbox, the relay routes
them to Kafka, the indexer's hint consumer reads them back: one definition for all four.
"""

from __future__ import annotations

import uuid
from typing import Final

INDEX_TASK_CREATED: Final = "IndexTaskCreated"
DOCUMENT_VERSION_PUBLISHED: Final = "DocumentVersionPublished"
DOCUMENT_SEARCH_VERSION_SWITCHED: Final = "DocumentSearchVersionSwitched"
DOCUMENT_DELETED: Final = "DocumentDeleted"
DOCUMENT_INDEXING_FAILED: Final = "DocumentIndexingFailed"

EVENT_TYPES: Final = frozenset(
    {
        INDEX_TASK_CREATED,
        DOCUMENT_VERSION_PUBLISHED,
        DOCUMENT_SEARCH_VERSION_SWITCHED,
        DOCUMENT_DELETED,
        DOCUMENT_INDEXING_FAILED,
    }
)

# uuid5 namespace of event ids: the same business change always gets the same event id, so
# a retried transaction writes the same id and consumers deduplicate on it.
EVENT_ID_NAMESPACE: Final = uuid.UUID("6f1c54a2-3b8e-5d0a-9c1e-2b7d4e8f0a13")

INDEX_HINTS_TOPIC: Final = "kb.index-hints."
DOCUMENT_EVENTS_TOPIC: Final = "kb.document-events"
# Publish by event (docs/architecture.md#publish-by-event): producers' signed commands, and
# the records that could not apply, per tier.
INGEST_TOPIC: Final = "kb.ingest."
INGEST_DEAD_TOPIC: Final = "kb.ingest-dead."


def event_id(event_type: str, *parts: object) -> uuid.UUID:
    """The stable id of the event ``event_type`` about ``parts`` (ids, versions, revisions)."""
    return uuid.uuid5(EVENT_ID_NAMESPACE, "/".join([event_type, *map(str, parts)]))


def index_hints_topic(tier: str, prefix: str = "") -> str:
    """Where a tier's indexers listen for wake-up hints (consumer group ``kb-indexer.<tier>``)."""
    return f"{prefix}{INDEX_HINTS_TOPIC}{tier}"


def document_events_topic(prefix: str = "") -> str:
    return f"{prefix}{DOCUMENT_EVENTS_TOPIC}"


def topic_for(event_type: str, tier: str, prefix: str = "") -> str:
    """Index hints go to their tier's topic; every other event is a lifecycle event."""
    if event_type == INDEX_TASK_CREATED:
        return index_hints_topic(tier, prefix)
    return document_events_topic(prefix)


def indexer_consumer_group(tier: str) -> str:
    return f"kb-indexer.{tier}"


def ingest_topic(tier: str, prefix: str = "") -> str:
    """Where producers send a tier's commands (consumer group ``kb-ingest.<tier>``)."""
    return f"{prefix}{INGEST_TOPIC}{tier}"


def ingest_dead_topic(tier: str, prefix: str = "") -> str:
    return f"{prefix}{INGEST_DEAD_TOPIC}{tier}"


def ingest_consumer_group(tier: str) -> str:
    return f"kb-ingest.{tier}"
