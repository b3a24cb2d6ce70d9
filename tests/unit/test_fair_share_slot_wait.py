"""When a search holds its slot (services/runtime/fair_share/phases.py): the gate admits it
without one, it takes one only to read, and a wait for one is bounded (security review,
issue 41). Through the app over PostgreSQL: tests/security/test_search_slots.py."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import REGISTRY

from services.runtime.fair_share.gate import FairShare
from services.runtime.fair_share.phases import between_search_phases, search_slot
from services.runtime.fair_share.settings import FairShareSettings, Kind
from services.runtime.fair_share.shares import SearchSlotWaitTimeout
from services.runtime.fair_share.slots import SearchSlots


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


def refused(tier: str) -> float:
    value = REGISTRY.get_sample_value(
        "kb_fair_share_refusals_total", {"kind": "search", "tier": tier, "reason": "slot_wait"}
    )
    return value or 0.0


async def test_a_wait_for_a_slot_ends_in_a_refusal_and_leaves_nothing_behind() -> None:
    slots = SearchSlots(1, wait_seconds=0.05)
    async with slots.slot("acme"):
        with pytest.raises(SearchSlotWaitTimeout) as refusal:
            async with slots.slot("globex"):
                raise AssertionError("not granted")
        assert refusal.value.code == "SEARCH_SLOT_WAIT_TIMEOUT"
        assert refusal.value.http_status == 429
        assert refusal.value.retry_after_seconds == 1
        assert (slots.in_use, slots.waiting()) == (1, 0)
    assert (slots.in_use, slots.waiting()) == (0, 0)
    async with slots.slot("globex"):  # the next one is served as ever
        assert slots.in_use == 1


async def test_a_wait_after_stepping_aside_is_bounded_too() -> None:
    slots = SearchSlots(1, wait_seconds=0.05)
    go, quiet_done = asyncio.Event(), asyncio.Event()

    async def busy() -> None:
        async with slots.slot("acme") as held:
            await go.wait()
            await held.step_aside()  # hands the slot to globex, which keeps it

    async def second_busy() -> None:
        async with slots.slot("acme"):
            pass

    async def quiet() -> None:
        async with slots.slot("globex"):
            await quiet_done.wait()

    first = asyncio.create_task(busy())
    await settle()
    queued = asyncio.create_task(second_busy())
    quiet_task = asyncio.create_task(quiet())
    await settle()
    go.set()
    with pytest.raises(SearchSlotWaitTimeout):
        await first
    with pytest.raises(SearchSlotWaitTimeout):
        await queued
    quiet_done.set()
    await quiet_task
    assert (slots.in_use, slots.waiting()) == (0, 0)


async def test_the_gate_admits_a_search_and_the_search_takes_its_slot_to_read() -> None:
    gate = FairShare(FairShareSettings(search_global_concurrency=1))
    assert gate.slots is not None
    async with gate.admit("acme", Kind.SEARCH):
        assert gate.shares.in_flight("acme", Kind.SEARCH) == 1
        assert gate.slots.in_use == 0  # admitted: no slot while it has not started reading
        async with search_slot():
            assert gate.slots.in_use == 1
            async with search_slot():  # a searcher inside a searcher: the same slot
                assert gate.slots.in_use == 1
        assert gate.slots.in_use == 0  # given back before the answer is written
    async with search_slot():  # outside a request: nothing to take
        assert gate.slots.in_use == 0
    assert gate.shares.tracked() == 0


async def test_the_gate_counts_a_search_refused_for_its_wait() -> None:
    gate = FairShare(
        FairShareSettings.model_validate(
            {"search_global_concurrency": 1, "search_slot_wait_seconds": 0.05}
        )
    )
    before = refused("unknown")
    release = asyncio.Event()

    async def holder() -> None:
        async with gate.share("acme", Kind.SEARCH):
            await release.wait()

    held = asyncio.create_task(holder())
    await settle()
    with pytest.raises(SearchSlotWaitTimeout):
        async with gate.admit("globex", Kind.SEARCH), search_slot():
            raise AssertionError("not granted")
    async with gate.admit("globex", Kind.SEARCH):
        await between_search_phases()  # admitted, no slot held: nothing to step aside from
    release.set()
    await held
    assert refused("unknown") == before + 1
    assert gate.shares.tracked() == 0
