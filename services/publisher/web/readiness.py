"""Readiness, checked at most once per interval however often probes arrive.

A probe answers from the last check while it is younger than ``cache_seconds``; concurrent
probes share one check. Why the service is not ready goes to the log, never to the caller:
migration names and database errors are for operators.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from services.runtime.errors import KbError
from services.runtime.logging import get_logger

log = get_logger(__name__)


class ReadinessProbe:
    def __init__(
        self,
        check: Callable[[], Awaitable[list[str]]],
        *,
        cache_seconds: float,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._check = check
        self._cache_seconds = cache_seconds
        self._monotonic = monotonic
        self._lock = asyncio.Lock()
        self._checked_at: float | None = None
        self._ready = False

    async def is_ready(self) -> bool:
        async with self._lock:
            now = self._monotonic()
            if self._checked_at is None or now - self._checked_at >= self._cache_seconds:
                self._ready = await self._run_check()
                self._checked_at = self._monotonic()
            return self._ready

    async def _run_check(self) -> bool:
        try:
            problems = await self._check()
        except KbError as error:
            problems = [f"{error.code}: {error.message}"]
        if problems:
            log.warning("readiness.not_ready", problems=problems)
        return not problems
