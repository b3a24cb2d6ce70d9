"""The relay's health gauges, refreshed by the supervisor: backlog and its oldest row's
age, partitions refused for another cluster's progress, and whether the live instances
can drive every partition at their cap (logged when they cannot)."""

from __future__ import annotations

from collections.abc import Callable

from services.relay import metrics
from services.relay.ports import RESEED_HINT, RelayPorts
from services.relay.settings import RelaySettings
from services.runtime.logging import get_logger

log = get_logger(__name__)


class Gauges:
    def __init__(
        self,
        settings: RelaySettings,
        owner: str,
        ports: RelayPorts,
        clock: Callable[[], float],
    ) -> None:
        self._settings = settings
        self._owner = owner
        self._ports = ports
        self._clock = clock
        self._refused: frozenset[int] = frozenset()
        self._refused_logged_at = float("-inf")
        self._uncovered = 0

    async def refresh(self) -> None:
        backlog = await self._ports.source.backlog()
        metrics.REFUSED_PARTITIONS.set(backlog.refused_partitions)
        if backlog.refused_partitions:
            # Unknown, not 0: those partitions' progress means nothing here.
            metrics.BACKLOG_ROWS.set(float("nan"))
            metrics.OLDEST_UNDELIVERED_AGE.set(float("nan"))
            await self._report_refused()
        else:
            metrics.BACKLOG_ROWS.set(backlog.rows)
            metrics.OLDEST_UNDELIVERED_AGE.set(backlog.oldest_age_s)
            self._refused = frozenset()
        await self._check_coverage()

    async def _check_coverage(self) -> None:
        """With a per-instance cap, the live instances may be too few to drive every
        partition: the rest would wait, undelivered, until another instance starts."""
        s = self._settings
        cap = s.relay_max_partitions_per_instance
        live = len(set(await self._ports.leases.live_owners()) | {self._owner})
        metrics.LIVE_INSTANCES.set(live)
        uncovered = max(0, s.relay_partitions - live * cap) if cap else 0
        metrics.UNCOVERABLE_PARTITIONS.set(uncovered)
        if uncovered and uncovered != self._uncovered:
            log.warning(
                "relay.partitions_uncovered",
                owner=self._owner,
                partitions=s.relay_partitions,
                max_partitions_per_instance=cap,
                live_instances=live,
                uncovered=uncovered,
                hint="start more relay instances or raise KB_RELAY_MAX_PARTITIONS_PER_INSTANCE",
            )
        self._uncovered = uncovered

    async def _report_refused(self) -> None:
        """Log the partitions refused for another cluster's progress: when the set changes,
        and again every minute while it lasts."""
        refusals = await self._ports.leases.refused_partitions()
        refused = frozenset(r.partition for r in refusals)
        now = self._clock()
        if refused == self._refused and now - self._refused_logged_at < 60.0:
            return
        self._refused, self._refused_logged_at = refused, now
        for refusal in refusals:
            log.error(
                "relay.cluster_changed",
                owner=self._owner,
                partition=refusal.partition,
                reason=refusal.reason,
                hint=RESEED_HINT,
            )
