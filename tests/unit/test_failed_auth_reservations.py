"""The failed-key throttle's reservations (services/runtime/auth/throttle.py): a try is held
while a key is looked up, given back when it was good, spent when it was wrong; a request
finding every try held waits rather than being refused; a held bucket is never forgotten; an
IPv6 /48's count holds back only its /64s that failed themselves."""

from __future__ import annotations

import asyncio

import pytest

from services.runtime.auth.throttle import FailedAuthThrottle, Refused, Reservation
from tests.support.clock import SecondsClock


def _throttle(clock: SecondsClock, **overrides: int) -> FailedAuthThrottle:
    values = {"burst": 2, "max_addresses": 10, **overrides}
    return FailedAuthThrottle(per_minute=6.0, clock=clock, **values)


async def test_a_released_try_is_given_back_and_a_failed_one_spent() -> None:
    clock = SecondsClock(1000.0)
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
    throttle = _throttle(SecondsClock(1000.0), burst=1)
    held = await throttle.reserve("10.0.0.2")
    assert isinstance(held, Reservation)
    waiting = asyncio.create_task(throttle.reserve("10.0.0.2"))
    await asyncio.sleep(0)  # one turn of the loop: the task runs until it waits
    assert throttle.waiting == 1
    assert not waiting.done()
    held.release()
    assert isinstance(await waiting, Reservation)


async def test_a_waiting_request_is_refused_when_the_held_try_fails() -> None:
    throttle = _throttle(SecondsClock(1000.0), burst=1)
    held = await throttle.reserve("10.0.0.3")
    assert isinstance(held, Reservation)
    waiting = asyncio.create_task(throttle.reserve("10.0.0.3"))
    await asyncio.sleep(0)  # one turn of the loop: the task runs until it waits
    assert throttle.waiting == 1
    assert held.failed()
    assert isinstance(await waiting, Refused)


async def test_a_bucket_with_a_lookup_running_is_never_forgotten() -> None:
    clock = SecondsClock(1000.0)
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
    throttle = _throttle(SecondsClock(1000.0))
    assert throttle.keys("::ffff:192.0.2.7") == ("192.0.2.7",)
    assert throttle.keys("2001:db8:1:2:3::9") == ("2001:db8:1:2::/64", "2001:db8:1::/48")
    assert throttle.keys("") == ("unknown",)


# --- the IPv6 network's count: only for a /64 that failed itself -----------------------------

NEIGHBOUR = "2001:db8:7:{:x}::1"  # /64s of one /48


def _empty_the_48(throttle: FailedAuthThrottle, burst: int, multiple: int) -> None:
    """One customer's /64s send wrong keys until the /48's count is spent."""
    for n in range(multiple):
        for _ in range(burst):
            throttle.record_failure(NEIGHBOUR.format(n))
    assert throttle.retry_after(NEIGHBOUR.format(0)) is not None


async def test_a_clean_64_is_not_refused_for_its_48_while_one_that_failed_is() -> None:
    throttle = _throttle(SecondsClock(1000.0), burst=2, network_multiple=2)
    _empty_the_48(throttle, burst=2, multiple=2)
    clean = "2001:db8:7:abcd::5"
    for _ in range(5):  # another customer's valid keys, again and again
        assert throttle.retry_after(clean) is None
        good = await throttle.reserve(clean)
        assert isinstance(good, Reservation)
        good.release()
    # A /64 that failed once itself has the /48's count against it from then on, even with
    # tries of its own left.
    tried = "2001:db8:7:beef::5"
    bad = await throttle.reserve(tried)
    assert isinstance(bad, Reservation)
    assert not bad.failed()  # one of its own two tries left
    refused = await throttle.reserve(tried)
    assert isinstance(refused, Refused)
    assert refused.retry_after == pytest.approx(5.0)  # the /48 earns a try back every 5 s
    assert throttle.retry_after(clean) is None  # still not its neighbours' doing


async def test_a_fresh_64_of_a_spent_48_has_one_lookup_at_a_time() -> None:
    # Concurrent wrong keys from a fresh /64 get one try, not a burst: the others wait for
    # it, and are refused when it fails; a good key's requests just take turns.
    throttle = _throttle(SecondsClock(1000.0), burst=3, network_multiple=2)
    _empty_the_48(throttle, burst=3, multiple=2)
    for host, good in (("2001:db8:7:100::1", False), ("2001:db8:7:200::1", True)):
        first = await throttle.reserve(host)
        assert isinstance(first, Reservation)
        second = asyncio.create_task(throttle.reserve(host))
        await asyncio.sleep(0)  # one turn of the loop: the task runs until it waits
        assert throttle.waiting == 1
        assert not second.done()
        if good:
            first.release()
            then = await second
            assert isinstance(then, Reservation)
            then.release()
        else:
            first.failed()
            assert isinstance(await second, Refused)
