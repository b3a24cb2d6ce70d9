"""The breaker's state machine, without a store or a clock."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from services.embedding.guard.breaker import (
    BREAKER_FAILURE_CODES,
    Breaker,
    BreakerPolicy,
    BreakerState,
)
from services.runtime.indexing.index_failures import ErrorCode

T0 = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
POLICY = BreakerPolicy(failure_threshold=3, open_seconds=30, max_open_seconds=100, probe_seconds=60)
DOWN = ErrorCode.EMBEDDING_UNAVAILABLE


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def opened() -> Breaker:
    breaker = Breaker()
    for _ in range(POLICY.failure_threshold):
        breaker = breaker.failed(DOWN, T0, POLICY)
    return breaker


def test_which_failures_count() -> None:
    assert {
        ErrorCode.EMBEDDING_UNAVAILABLE,
        ErrorCode.EMBEDDING_TIMEOUT,
        ErrorCode.EMBEDDING_RESPONSE_MALFORMED,
    } == BREAKER_FAILURE_CODES
    # Metered or answered on purpose: the provider is up.
    assert ErrorCode.EMBEDDING_RATE_LIMITED not in BREAKER_FAILURE_CODES
    assert ErrorCode.EMBEDDING_RESPONSE_INVALID not in BREAKER_FAILURE_CODES


def test_it_opens_at_the_threshold_of_consecutive_failures() -> None:
    breaker = Breaker()
    for count in (1, 2):
        breaker = breaker.failed(DOWN, T0, POLICY)
        assert (breaker.state, breaker.consecutive_failures) == (BreakerState.CLOSED, count)
    breaker = breaker.failed(ErrorCode.EMBEDDING_TIMEOUT, at(1), POLICY)
    assert breaker.state is BreakerState.OPEN
    assert (breaker.opened_at, breaker.open_until) == (at(1), at(31))
    assert breaker.last_failure_code == ErrorCode.EMBEDDING_TIMEOUT


def test_a_success_resets_the_count() -> None:
    breaker = Breaker().failed(DOWN, T0, POLICY).failed(DOWN, T0, POLICY)
    breaker = breaker.succeeded(at(1))
    assert breaker.pristine
    assert breaker.last_success_at == at(1)
    assert breaker.failed(DOWN, at(2), POLICY).state is BreakerState.CLOSED


def test_open_until_due_then_exactly_one_probe() -> None:
    breaker = opened()
    assert not breaker.probe_due(at(29))
    assert breaker.take_probe("a", at(29), POLICY) is None
    probing = breaker.take_probe("a", at(30), POLICY)
    assert probing is not None
    assert (probing.state, probing.probe_owner, probing.probe_until) == (
        BreakerState.HALF_OPEN,
        "a",
        at(90),
    )
    assert probing.take_probe("b", at(31), POLICY) is None
    # The owner asking again keeps its probe, deadline unchanged.
    assert probing.take_probe("a", at(31), POLICY) == probing


def test_the_probe_answering_closes_it() -> None:
    probing = opened().take_probe("a", at(30), POLICY)
    assert probing is not None
    closed = probing.succeeded(at(31))
    assert closed.state is BreakerState.CLOSED
    assert closed.pristine
    assert (closed.opened_at, closed.open_until, closed.probe_owner) == (None, None, None)


def test_a_failed_probe_reopens_for_twice_as_long_up_to_the_max() -> None:
    probing = opened().take_probe("a", at(30), POLICY)
    assert probing is not None
    reopened = probing.failed(DOWN, at(31), POLICY, probe_owner="a")
    assert reopened.state is BreakerState.OPEN
    assert (reopened.opened_at, reopened.open_until) == (at(31), at(91))
    assert reopened.probe_owner is None
    again = reopened.take_probe("b", at(91), POLICY)
    assert again is not None
    third = again.failed(DOWN, at(92), POLICY, probe_owner="b")
    assert third.open_until == at(92 + 100)  # 120 s capped at 100


def test_a_failure_that_is_not_the_probe_changes_only_the_count() -> None:
    probing = opened().take_probe("a", at(30), POLICY)
    assert probing is not None
    # A request sent before the breaker opened fails now; or someone else's probe owner.
    stale = probing.failed(DOWN, at(31), POLICY)
    other = probing.failed(DOWN, at(31), POLICY, probe_owner="b")
    for breaker in (stale, other):
        assert breaker.state is BreakerState.HALF_OPEN
        assert breaker.probe_owner == "a"
        assert breaker.consecutive_failures == probing.consecutive_failures + 1
    # While open, failures do not extend it.
    still = opened().failed(DOWN, at(10), POLICY)
    assert still.open_until == at(30)


def test_a_vanished_probe_owner_lets_another_probe_after_probe_seconds() -> None:
    probing = opened().take_probe("a", at(30), POLICY)
    assert probing is not None
    assert probing.take_probe("b", at(89), POLICY) is None
    taken = probing.take_probe("b", at(90), POLICY)
    assert taken is not None
    assert (taken.probe_owner, taken.probe_until) == ("b", at(150))
    # The vanished owner's late failure no longer reopens the breaker.
    late = taken.failed(DOWN, at(91), POLICY, probe_owner="a")
    assert late.state is BreakerState.HALF_OPEN


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"failure_threshold": 0}, "failure_threshold"),
        ({"open_seconds": 0}, "open_seconds"),
        ({"open_seconds": 10, "max_open_seconds": 5}, "max_open_seconds"),
        ({"probe_seconds": 0}, "probe_seconds"),
    ],
)
def test_a_policy_refuses_nonsense(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BreakerPolicy(**options)
