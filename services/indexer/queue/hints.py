"""Kafka index hints: a message on ``kb.index-hints.<tier>`` only wakes the claim loop.

The consumer joins the tier's consumer group, so several indexer processes of one tier
share the hints and a hint wakes one of them. It never claims anything itself: the claim
is still the leased SQL, filtered by tier, and the worker polls on a timer as well, so a
lost, late, duplicated or replayed hint costs latency, never work.

What it guarantees:
- a burst of hints causes a bounded number of wake-ups: one per batch read, and the worker's
  wake-up is an event that coalesces further ones until its loop consumes it;
- offsets are committed after the wake (at least once);
- input never crashes it: an undecodable message, an unknown schema fingerprint, an unknown
  event type or another tier's hint is counted, logged once per kind, and skipped;
- Kafka down or unreachable (at start or later) is logged once per outage and retried with
  backoff; the worker keeps working by polling meanwhile, and ``connected`` says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from services.indexer.queue.attempt_span import HintContexts
from services.runtime.logging import get_logger
from services.runtime.messaging.avro import AvroError, SchemaRegistry, default_registry
from services.runtime.messaging.events import INDEX_TASK_CREATED
from services.runtime.signals import ignoring_foreign_cancellation, unless_stopped
from services.runtime.tracing.propagation import TRACEPARENT

log = get_logger(__name__)

# The most bytes of one message we look at: a hint is a few hundred bytes.
MAX_HINT_BYTES = 64 * 1024


class SkipReason:
    """Why a message woke nothing (a metric label: few values, never an id)."""

    TOO_LARGE = "too_large"
    UNDECODABLE = "undecodable"
    UNKNOWN_FINGERPRINT = "unknown_fingerprint"
    UNKNOWN_EVENT_TYPE = "unknown_event_type"
    OTHER_TIER = "other_tier"


@dataclass(frozen=True)
class HintMessage:
    """What the consumer needs of one Kafka record."""

    value: bytes | None
    headers: Mapping[str, bytes]


class HintSource(Protocol):
    """A started consumer of the tier's hint topic (aiokafka in production)."""

    async def read(self, timeout_seconds: float) -> list[HintMessage]:
        """The next records (possibly none after the timeout); raises on a broken connection."""
        ...

    async def commit(self) -> None:
        """Commit the offsets of everything returned by ``read`` so far."""
        ...

    async def close(self) -> None: ...


HintSourceFactory = Callable[[], "asyncio.Future[HintSource] | Any"]


@dataclass
class HintStats:
    """Counters the metrics module exports; plain numbers so tests read them directly."""

    received: int = 0
    woke: int = 0  # wake-ups handed to the worker (at most one per batch read)
    coalesced: int = 0  # valid hints that rode on another hint's wake-up
    skipped: dict[str, int] = field(default_factory=dict)
    connected: bool = False
    outages: int = 0

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1


class HintConsumer:
    def __init__(
        self,
        *,
        tier: str,
        wake: Callable[[], None],
        connect: Callable[[], Any],
        registry: SchemaRegistry | None = None,
        read_timeout_seconds: float = 1.0,
        reconnect_min_seconds: float = 0.5,
        reconnect_max_seconds: float = 30.0,
        stats: HintStats | None = None,
        on_change: Callable[[HintStats], None] | None = None,
        rng: random.Random | None = None,
        contexts: HintContexts | None = None,
    ) -> None:
        self.tier = tier
        self._wake = wake
        self._connect = connect  # async () -> HintSource (started)
        self._registry = registry or default_registry()
        self._read_timeout = read_timeout_seconds
        self._reconnect_min = reconnect_min_seconds
        self._reconnect_max = reconnect_max_seconds
        self.stats = stats or HintStats()
        self._on_change = on_change
        self._rng = rng or random.Random()
        self._logged_kinds: set[str] = set()
        # Each hint's trace context, for the attempt at its task to link to.
        self._contexts = contexts

    async def run(self, stop: asyncio.Event) -> None:
        """Consume until ``stop`` is set; never raises for Kafka trouble or bad input."""
        failures = 0
        while not stop.is_set():
            source: HintSource | None = None
            try:
                source = await self._connect_unless_stopped(stop)
                if source is None:
                    break
                self._set_connected(True)
                failures = 0
                while not stop.is_set():
                    messages = await source.read(self._read_timeout)
                    if messages:
                        self.handle(messages)
                        await source.commit()
            except asyncio.CancelledError:
                raise
            except Exception as error:  # Kafka unreachable, broker gone, commit refused
                failures += 1
                if self.stats.connected or failures == 1:
                    self.stats.outages += 1
                    log.warning(
                        "hints.unavailable",
                        tier=self.tier,
                        error=f"{type(error).__name__}: {error}",
                        polling=True,
                    )
                self._set_connected(False)
                delay = self._reconnect_delay(failures)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), delay)
            finally:
                if source is not None:
                    await _close(source)
        self._set_connected(False)

    async def _connect_unless_stopped(self, stop: asyncio.Event) -> HintSource | None:
        """The source, or None once ``stop`` is set first: joining the group can take as long
        as its rebalance (a killed member is waited for until its session expires, then up to
        the join's own bound), and a stopping worker must not wait for that -- an
        orchestrator's grace period is often 30 s. The connect is cancelled (it closes what
        it opened)."""
        connecting = await unless_stopped(self._connect(), stop)
        if connecting.cancelled():
            return None
        source: HintSource = connecting.result()  # its failure is run()'s to count
        return source

    def handle(self, messages: Iterable[HintMessage]) -> bool:
        """Wake the worker once if any message is a valid hint for this tier."""
        valid = 0
        for message in messages:
            self.stats.received += 1
            reason = self._skip_reason(message)
            if reason is None:
                valid += 1
            else:
                self.stats.skip(reason)
                if reason not in self._logged_kinds:
                    self._logged_kinds.add(reason)
                    log.warning("hints.skipped", tier=self.tier, reason=reason)
        if valid:
            self._wake()
            self.stats.woke += 1
            self.stats.coalesced += valid - 1
        if self._on_change is not None:
            self._on_change(self.stats)
        return valid > 0

    def _skip_reason(self, message: HintMessage) -> str | None:
        payload = message.value
        if payload is None:
            return SkipReason.UNDECODABLE
        if len(payload) > MAX_HINT_BYTES:
            return SkipReason.TOO_LARGE
        header_type = message.headers.get("event_type")
        if header_type is not None and header_type != INDEX_TASK_CREATED.encode():
            return SkipReason.UNKNOWN_EVENT_TYPE
        try:
            decoded = self._registry.decode(payload)
        except AvroError as error:
            if error.code == "AVRO_UNKNOWN_FINGERPRINT":
                return SkipReason.UNKNOWN_FINGERPRINT
            if error.code == "AVRO_UNKNOWN_EVENT_TYPE":
                return SkipReason.UNKNOWN_EVENT_TYPE
            return SkipReason.UNDECODABLE
        except Exception:  # a hostile payload must not take the consumer down
            return SkipReason.UNDECODABLE
        if decoded.event_type != INDEX_TASK_CREATED:
            return SkipReason.UNKNOWN_EVENT_TYPE
        if decoded.record.get("tier") != self.tier:
            return SkipReason.OTHER_TIER
        traceparent = message.headers.get(TRACEPARENT)
        task_id = decoded.record.get("taskId")
        if self._contexts is not None and traceparent is not None and task_id is not None:
            self._contexts.remember(str(task_id), traceparent)
        return None

    def _reconnect_delay(self, failures: int) -> float:
        capped = min(self._reconnect_max, self._reconnect_min * 2.0 ** min(failures - 1, 30))
        return capped * (1.0 - 0.5 * self._rng.random())

    def _set_connected(self, connected: bool) -> None:
        if self.stats.connected != connected:
            self.stats.connected = connected
            if connected:
                log.info("hints.connected", tier=self.tier)
            if self._on_change is not None:
                self._on_change(self.stats)


async def _close(source: HintSource) -> None:
    """Close a source whatever it raises, except a cancellation of this very task: a
    client library's own cancelled internals must not end the consumer."""
    with contextlib.suppress(Exception):
        await ignoring_foreign_cancellation(source.close())
