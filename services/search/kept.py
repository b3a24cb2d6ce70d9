"""Answers kept a short while, for searches that would otherwise read them every time: at
most ``max_entries``, each for ``ttl_seconds`` (0: none kept), the least recently used
forgotten first. The vector paths (paths.py) and the tenants' common words
(keyword_terms.py) are kept this way."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


@dataclass(eq=False)
class KeptFor(Generic[K, V]):
    ttl_seconds: float
    max_entries: int
    clock: Callable[[], float] = time.monotonic
    _entries: OrderedDict[K, tuple[float, V]] = field(init=False, default_factory=OrderedDict)

    def __post_init__(self) -> None:
        if self.ttl_seconds < 0 or self.max_entries < 1:
            raise ValueError("kept answers need ttl_seconds >= 0 and max_entries >= 1")

    def get(self, key: K) -> V | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        expires, value = entry
        if self.clock() >= expires:
            del self._entries[key]
            return None
        self._entries.move_to_end(key)
        return value

    def put(self, key: K, value: V) -> None:
        if self.ttl_seconds == 0:
            return
        self._entries[key] = (self.clock() + self.ttl_seconds, value)
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def forget(self, key: K) -> None:
        self._entries.pop(key, None)

    def __len__(self) -> int:
        return len(self._entries)
