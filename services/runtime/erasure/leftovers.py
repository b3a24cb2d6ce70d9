"""What a deleted document still holds that it may not (docs/architecture.md#document-
lifecycle): counts and ids only, read by ``erase_pg.PgErasureStore.leftovers`` for `kb index
check`, which decides from them what drifted."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime


@dataclass(frozen=True)
class Leftovers:
    """One deleted document, as the check reads it in one snapshot."""

    tenant_id: str
    document_id: uuid.UUID
    deleted_at: datetime
    # The erase's audit row: None when no erase was asked for; erased_at None while in
    # progress (or left half-done).
    erase_requested_at: datetime | None
    erased_at: datetime | None
    # The pointer is the tombstone the delete wrote; its version (None: there is none).
    tombstoned: bool
    pointer_version: int | None
    # Never kept by a deleted document (nothing serves them again: the delete is final).
    chunks: int
    staged_slices: int
    served_acl: int
    # Removed by the erase: counted only once an erase was asked for (0 before).
    version_bytes: int
    version_acl: int
    task_messages: int
    requeue_messages: int
    outbox_events: int  # outbox rows whose event still carries a title or principals
    title_kept: bool

    @property
    def erase_requested(self) -> bool:
        return self.erase_requested_at is not None

    def erase_leftovers(self) -> dict[str, int]:
        """What only the erase removes and is still there, by name (the zeros left out)."""
        counts = {
            "version bytes": self.version_bytes,
            "version ACL rows": self.version_acl,
            "task error texts": self.task_messages,
            "requeue error texts": self.requeue_messages,
            "outbox events with content": self.outbox_events,
            "title": int(self.title_kept),
        }
        return {name: count for name, count in counts.items() if count}
