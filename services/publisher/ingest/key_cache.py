"""A tenant's ingest keys, kept for a short while (``KB_INGEST_KEY_CACHE_SECONDS``): a run of
commands is verified without a database round trip per command, and the keys it lacks are
read in one. A revoked key is accepted at most that long after its revocation (a key found
is kept that long, never longer); a key not found is not kept, so a key just registered
works at once.

Bounded, so a long-running process does not grow with every tenant it has seen: an entry
past its time is dropped when met, and all of them by a sweep once a period; at most
``max_entries`` are kept, the least recently used going first. A bound, not a setting: an
entry dropped early costs one read of the keys, never a wrong answer."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from services.publisher.ingest.signing import IngestKey

Lookup = Callable[[str, list[str]], Awaitable[dict[str, IngestKey]]]

# A few hundred bytes an entry: some megabytes at most, more (tenant, key) pairs than a
# process applies commands of within one KB_INGEST_KEY_CACHE_SECONDS.
MAX_ENTRIES = 10_000


@dataclass
class KeyCache:
    lookup: Lookup
    ttl_seconds: float
    clock: Callable[[], float] = time.monotonic
    max_entries: int = MAX_ENTRIES
    # (tenant, key id) -> the key and when it was read; least recently used first.
    _kept: OrderedDict[tuple[str, str], tuple[IngestKey, float]] = field(
        default_factory=OrderedDict
    )
    _swept: float = float("-inf")

    def __len__(self) -> int:
        return len(self._kept)

    async def keys(self, tenant_id: str, key_ids: Iterable[str]) -> dict[str, IngestKey]:
        """The tenant's live keys among ``key_ids``, by id (read once for those not kept)."""
        now = self.clock()
        if now - self._swept >= self.ttl_seconds:
            self.sweep(now)
        found: dict[str, IngestKey] = {}
        missing: list[str] = []
        for key_id in dict.fromkeys(k for k in key_ids if k):
            entry = (tenant_id, key_id)
            kept = self._kept.get(entry)
            if kept is not None and now - kept[1] < self.ttl_seconds:
                self._kept.move_to_end(entry)
                found[key_id] = kept[0]
            else:
                self._kept.pop(entry, None)
                missing.append(key_id)
        if missing:
            read = await self.lookup(tenant_id, missing)
            for key_id, key in read.items():
                if self.ttl_seconds > 0:
                    self._keep((tenant_id, key_id), key, now)
                found[key_id] = key
        return found

    def sweep(self, now: float | None = None) -> None:
        """Drop every entry past its time (the read time is not in the order of use: all
        are looked at, once a period)."""
        now = self.clock() if now is None else now
        self._swept = now
        for entry in [e for e, (_, read) in self._kept.items() if now - read >= self.ttl_seconds]:
            del self._kept[entry]

    def _keep(self, entry: tuple[str, str], key: IngestKey, now: float) -> None:
        self._kept[entry] = (key, now)
        self._kept.move_to_end(entry)
        while len(self._kept) > self.max_entries:
            self._kept.popitem(last=False)
