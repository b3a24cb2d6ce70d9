"""The failed-key throttle's reservations (services/runtime/auth/throttle.py): a try is held
while a key is looked up, given back when it was good, spent when it was wrong; a request
finding every try held waits rather than being refused; a held bucket is never forgotten."""

from __future__ import annotations

import asyncio

import pytest

from services.runtime.auth.throttle import FailedAuthThrottle, Refused, Reservation


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _throttle(clock: Clock, **overrides: int) -> FailedAuthThrottle:
    values = {"burst": 2, "max_addresses": 10, **overrides}
    return FailedAuthThrottle(per_minute=6.0, clock=clock, **values)


async def test_a_released_try_is_given_back_and_a_failed_one_spent() -> None:
    clock = Clock()
    throttle = _throttle(clock)
    good = await throttle.reserve("10.0.0.1")
    assert isinstance(good, Reservation)
    good.release()
    good.failed()  # resolved already: changes nothing
    assert len(throttle) == 0  # nothing held, nothing failed: nothing remembered
    first = await throttle.reserve("10.0.0.1")
    second = await throttle.reserve("10.0.0.1")
    assert isinstance(first, Reservation)
    assert isinstance(second, Reservation)
    assert not first.failed()
    assert second.failed()  # the one that left no try
    refused = await throttle.reserve("10.0.0.1")
    assert isinstance(refused, Refused)
    assert refused.retry_after == pytest.approx(10.0)


async def test_a_request_waits_while_its_tries_are_held_and_goes_on_when_one_is_back() -> None:
    throttle = _throttle(Clock(), burst=1)
    held = await throttle.reserve("10.0.0.2")
    assert isinstance(held, Reservation)
    waiting = asyncio.create_task(throttle.reserve("10.0.0.2"))
    await asyncio.sleep(0)  # one turn of the loop: the task runs until it waits
    assert throttle.waiting == 1
    assert not waiting.done()
    held.release()
    assert isinstance(await waiting, Reservation)


async def test_a_waiting_request_is_refused_when_the_held_try_fails() -> None:
    throttle = _throttle(Clock(), burst=1)
    held = await throttle.reserve("10.0.0.3")
    assert isinstance(held, Reservation)
    waiting = asyncio.create_task(throttle.reserve("10.0.0.3"))
    await asyncio.sleep(0)  # one turn of the loop: the task runs until it waits
    assert throttle.waiting == 1
    assert held.failed()
    assert isinstance(await waiting, Refused)


async def test_a_bucket_with_a_lookup_running_is_never_forgotten() -> None:
    clock = Clock()
    throttle = _throttle(clock, burst=3, max_addresses=5)
    throttle.record_failure("10.0.0.4")
    held = await throttle.reserve("10.0.0.4")
    assert isinstance(held, Reservation)
    for i in range(50):  # each fails more than 10.0.0.4 did: all would outrank it
        for _ in range(3):
            throttle.record_failure(f"10.9.0.{i}")
    assert not held.failed()  # two of its three tries spent: not forgotten meanwhile
    assert throttle.retry_after("10.0.0.4") is None
    assert throttle.record_failure("10.0.0.4")


def test_an_ipv4_mapped_address_is_its_ipv4_address() -> None:
    throttle = _throttle(Clock())
    assert throttle.keys("::ffff:192.0.2.7") == ("192.0.2.7",)
    assert throttle.keys("2001:db8:1:2:3::9") == ("2001:db8:1:2::/64", "2001:db8:1::/48")
    assert throttle.keys("") == ("unknown",)
