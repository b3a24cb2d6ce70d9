"""The retry policy of index tasks: how a failure is decided by its code, and the two
budgets (docs/architecture.md#retries-and-failure-codes). Pure Python, as the task model
beside it (task.py), which applies the decision under the fence (``settle``).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Final

from services.indexer.task import (
    PROVIDER_FAILURE_CODES,
    RETRYABLE_CODES,
    TERMINAL_CODES,
    FailureDecision,
    Lease,
    TaskStatus,
    redact,
)
from services.runtime.backoff import Backoff

# The default of KB_INDEXER_PROVIDER_FAILURE_BUDGET_SECONDS: a day from the first one.
DEFAULT_PROVIDER_FAILURE_BUDGET_SECONDS: Final = 86_400.0


@dataclass(frozen=True)
class RetryPolicy:
    """Decide by code and the error's ``retriable`` flag, never by message: terminal codes
    go DEAD at once; a retriable error (the flag; for a bare code, ``RETRYABLE_CODES``)
    waits the shared backoff (services.runtime.backoff: exponential, capped, jittered),
    never less than the Retry-After it carries.

    Two budgets (docs/architecture.md#retries-and-failure-codes):

    - Provider-side failures (``PROVIDER_FAILURE_CODES``: rate limited, timeout, unavailable,
      a malformed answer) say nothing about the document: they follow a *time* budget,
      ``provider_failure_budget_seconds`` from the task's first such failure, and spend none
      of the attempt budget. Their Retry-After is waited for however long it is -- the task
      is parked in RETRY_WAIT, at most until the budget's end -- and once the budget is spent
      the task goes DEAD with its last code and a message that says so. The decision leaves
      that to the fenced fail (:func:`settle`), the one place that knows when the first
      failure was and what time it is by the database's clock.
    - Any other retriable failure spends an attempt: once ``lease_attempt >= max_attempts``
      the task goes DEAD with its last code. A Retry-After it carries beyond
      ``max_retry_after_seconds`` (default: the backoff cap) is not waited for: the task
      goes DEAD at once, and the message says why."""

    backoff_base_seconds: float = 2.0
    backoff_cap_seconds: float = 600.0
    jitter: float = 0.2
    max_retry_after_seconds: float | None = None
    provider_failure_budget_seconds: float = DEFAULT_PROVIDER_FAILURE_BUDGET_SECONDS

    def __post_init__(self) -> None:
        if self.max_retry_after_seconds is not None and not self.max_retry_after_seconds > 0:
            raise ValueError("max_retry_after_seconds must be > 0")
        if not 0 < self.provider_failure_budget_seconds < math.inf:
            raise ValueError("provider_failure_budget_seconds must be > 0 and finite")

    @property
    def backoff(self) -> Backoff:
        return Backoff(self.backoff_base_seconds, self.backoff_cap_seconds, self.jitter)

    @property
    def retry_after_limit(self) -> float:
        """The longest Retry-After a failure outside the provider budget waits for."""
        if self.max_retry_after_seconds is None:
            return self.backoff_cap_seconds
        return self.max_retry_after_seconds

    def backoff_seconds(self, lease_attempt: int, rng: random.Random | None = None) -> float:
        return self.backoff.delay(lease_attempt, rng)

    def decide(
        self,
        lease: Lease,
        error_code: str,
        error_message: str,
        *,
        retry_after_seconds: float | None = None,
        retriable: bool | None = None,
        rng: random.Random | None = None,
    ) -> FailureDecision:
        message = redact(error_message)
        flagged = error_code in RETRYABLE_CODES if retriable is None else retriable
        if not flagged or error_code in TERMINAL_CODES:
            return FailureDecision(TaskStatus.DEAD, error_code, message, 0.0)
        delay = self.backoff_seconds(lease.lease_attempt, rng)
        if error_code in PROVIDER_FAILURE_CODES:
            return self._provider_failure(error_code, error_message, delay, retry_after_seconds)
        if lease.lease_attempt >= lease.max_attempts:
            return FailureDecision(TaskStatus.DEAD, error_code, message, 0.0)
        if retry_after_seconds is not None:
            limit = self.retry_after_limit
            # NaN compares false with everything: "not <=" treats it as beyond the limit.
            if not retry_after_seconds <= limit:
                return FailureDecision(
                    TaskStatus.DEAD,
                    error_code,
                    redact(
                        f"{error_message} (Retry-After {retry_after_seconds:g} s is beyond "
                        f"the {limit:g} s a task may wait)"
                    ),
                    0.0,
                )
            delay = max(delay, retry_after_seconds)
        return FailureDecision(TaskStatus.RETRY_WAIT, error_code, message, delay)

    def _provider_failure(
        self, error_code: str, error_message: str, backoff: float, retry_after: float | None
    ) -> FailureDecision:
        """RETRY_WAIT on the time budget: the backoff, or the Retry-After if longer (a
        Retry-After that is not a number, infinite or beyond the budget parks the task to the
        budget's end); ``settle`` caps it at the budget's end or ends the task DEAD."""
        budget = self.provider_failure_budget_seconds
        delay = backoff
        if retry_after is not None:
            # NaN compares false with everything: "not <=" parks it for the whole budget.
            delay = max(delay, retry_after) if retry_after <= budget else budget
        return FailureDecision(
            TaskStatus.RETRY_WAIT,
            error_code,
            redact(error_message),
            min(delay, budget),
            provider_budget_seconds=budget,
            budget_spent_message=redact(
                f"provider-side failures went on for the whole {budget:g} s budget since "
                f"the task's first one (KB_INDEXER_PROVIDER_FAILURE_BUDGET_SECONDS); the "
                f"last: {error_message}"
            ),
        )
