"""A tenant's ingest keys, kept for a short while (``KB_INGEST_KEY_CACHE_SECONDS``): a run of
commands is verified without a database round trip per command, and the keys it lacks are
read in one. A revoked key is accepted at most that long after its revocation (a key found
is kept that long, never longer); a key not found is not kept, so a key just registered
works at once."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from services.publisher.ingest.signing import IngestKey

Lookup = Callable[[str, list[str]], Awaitable[dict[str, IngestKey]]]


@dataclass
class KeyCache:
    lookup: Lookup
    ttl_seconds: float
    clock: Callable[[], float] = time.monotonic
    _kept: dict[tuple[str, str], tuple[IngestKey, float]] = field(default_factory=dict)

    async def keys(self, tenant_id: str, key_ids: Iterable[str]) -> dict[str, IngestKey]:
        """The tenant's live keys among ``key_ids``, by id (read once for those not kept)."""
        now = self.clock()
        found: dict[str, IngestKey] = {}
        missing: list[str] = []
        for key_id in dict.fromkeys(k for k in key_ids if k):
            kept = self._kept.get((tenant_id, key_id))
            if kept is not None and now - kept[1] < self.ttl_seconds:
                found[key_id] = kept[0]
            else:
                self._kept.pop((tenant_id, key_id), None)
                missing.append(key_id)
        if missing:
            read = await self.lookup(tenant_id, missing)
            for key_id, key in read.items():
                if self.ttl_seconds > 0:
                    self._kept[(tenant_id, key_id)] = (key, now)
                found[key_id] = key
        return found
