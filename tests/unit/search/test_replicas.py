"""The replica rotation without servers: tokens, names, lag from WAL positions, the choice of
server and the wait for a token (services/search/replicas.py). The same on real replicas:
tests/integration/test_search_replicas.py."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from services.runtime.errors import ValidationFailed
from services.runtime.tracing.spans import span_under
from services.search.primary_position import PrimaryPosition, SearchTokenAhead
from services.search.replicas import (
    PRIMARY,
    ReplicaRotation,
    comparable,
    format_token,
    parse_token,
    replica_name,
)
from services.search.statements import SearchSettings
from tests.support.tracing import one, parent_id, span_id, traced


class FakePool:
    """Answers the rotation's one query with a position (or raises)."""

    def __init__(self, position: int) -> None:
        self.position = position
        self.down = False
        self.reads = 0
        self.read_thrice = asyncio.Event()

    # asyncpg's signature, timeout included.
    async def fetchval(self, query: str, *args: Any, timeout: float | None = None) -> int:  # noqa: ASYNC109
        self.reads += 1
        if self.reads >= 3:
            self.read_thrice.set()
        if self.down:
            raise OSError("connection refused")
        return self.position

    async def fetchrow(self, query: str, *args: Any) -> tuple[int, int]:
        return (8192, 16 << 20)  # wal_block_size, wal_segment_size


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def rotation(
    primary: FakePool,
    replicas: dict[str, FakePool],
    *,
    clock: Clock | None = None,
    max_lag: float = 1.0,
    wait: float = 0.0,
) -> ReplicaRotation:
    return ReplicaRotation(
        primary,  # type: ignore[arg-type]
        list(replicas.items()),  # type: ignore[arg-type]
        max_lag_seconds=max_lag,
        after_wait_seconds=wait,
        check_seconds=0.5,
        clock=clock or time.monotonic,
    )


def test_tokens_round_trip_as_postgres_prints_them() -> None:
    assert parse_token("16/B374D848") == (0x16 << 32) | 0xB374D848
    assert format_token(parse_token("16/B374D848")) == "16/B374D848"
    assert parse_token("0/0") == 0
    for bad in ("", "16", "16/", "/1", "G/1", "1/123456789", "1/2/3"):
        with pytest.raises(ValidationFailed):
            parse_token(bad)


def test_a_replica_is_named_without_its_credentials() -> None:
    assert replica_name("postgresql://kb:secret@db-r1.internal:6432/kb") == "db-r1.internal:6432/kb"
    assert replica_name("postgresql://kb@10.0.0.5/kb") == "10.0.0.5:5432/kb"


def test_settings_list_replica_urls() -> None:
    settings = SearchSettings(search_database_urls=" postgresql://a/kb, postgresql://b/kb ,")
    assert settings.search_replica_urls == ("postgresql://a/kb", "postgresql://b/kb")
    assert SearchSettings().search_replica_urls == ()
    with pytest.raises(ValueError, match="postgresql:// URLs"):
        SearchSettings(search_database_urls="mysql://a/kb")


async def test_searches_take_the_caught_up_replicas_in_turn() -> None:
    primary = FakePool(100)
    replicas = {"r1": FakePool(100), "r2": FakePool(100)}
    rot = rotation(primary, replicas)
    # Before the first check nothing is known: the primary.
    assert (await rot.choose()).name == PRIMARY
    await rot.check()
    assert {(await rot.choose()).name for _ in range(4)} == {"r1", "r2"}


async def test_lag_is_the_age_of_the_oldest_position_not_replayed() -> None:
    clock = Clock()
    primary = FakePool(100)
    replica = FakePool(100)
    rot = rotation(primary, {"r": replica}, clock=clock, max_lag=1.0)
    await rot.check()
    # The primary idles: the lag stays 0 however long, unlike now() - last replay time.
    clock.now = 60.0
    await rot.check()
    assert rot.views()[0].lag_seconds == 0.0
    # The primary writes; the replica does not replay it.
    primary.position = 200
    clock.now = 61.0
    await rot.check()
    assert rot.views()[0].lag_seconds == 0.0  # the primary had it only at this check
    primary.position = 300
    clock.now = 61.8
    await rot.check()
    view = rot.views()[0]
    assert view.lag_seconds == pytest.approx(0.8)
    assert view.in_rotation
    clock.now = 62.5
    await rot.check()
    view = rot.views()[0]
    assert view.lag_seconds == pytest.approx(1.5)
    assert not view.in_rotation
    assert (await rot.choose()).name == PRIMARY
    # It replays part of it: its lag is now that of the oldest position it lacks.
    replica.position = 250
    clock.now = 63.0
    await rot.check()
    assert rot.views()[0].lag_seconds == pytest.approx(1.2)
    replica.position = 300
    clock.now = 63.5
    await rot.check()
    view = rot.views()[0]
    assert view.lag_seconds == 0.0
    assert view.in_rotation


async def test_a_replica_that_does_not_answer_leaves_the_rotation() -> None:
    clock = Clock()
    replica = FakePool(100)
    rot = rotation(FakePool(100), {"r": replica}, clock=clock)
    await rot.check()
    replica.down = True
    clock.now = 0.5
    await rot.check()
    view = rot.views()[0]
    assert not view.in_rotation
    assert view.error is not None
    assert "OSError" in view.error
    assert (await rot.choose()).name == PRIMARY
    replica.down = False
    await rot.check()
    assert rot.views()[0].in_rotation


async def test_a_token_goes_to_a_replica_that_replayed_it_else_waits_else_the_primary() -> None:
    primary = FakePool(500)
    behind, ahead = FakePool(100), FakePool(400)
    rot = rotation(primary, {"behind": behind, "ahead": ahead}, max_lag=3600)
    await rot.check()
    assert {(await rot.choose(after=300)).name for _ in range(3)} == {"ahead"}
    # No replica has it, no wait: the primary at once.
    target = await rot.choose(after=450)
    assert target.name == PRIMARY
    assert target.waited_seconds < 0.5


async def test_a_waiting_token_is_answered_once_a_replica_replays_it() -> None:
    primary = FakePool(500)
    replica = FakePool(100)
    rot = rotation(primary, {"r": replica}, max_lag=3600, wait=5.0)
    await rot.check()
    waiting = asyncio.create_task(rot.choose(after=450))
    await replica.read_thrice.wait()  # the poller reads it while the search waits
    assert not waiting.done()
    replica.position = 460
    target = await waiting
    assert target.name == "r"
    assert target.waited_seconds < 5.0


async def test_a_token_no_replica_reaches_goes_to_the_primary_after_the_wait() -> None:
    rot = rotation(FakePool(500), {"r": FakePool(100)}, max_lag=3600, wait=0.05)
    await rot.check()
    target = await rot.choose(after=450)
    assert target.name == PRIMARY
    assert target.waited_seconds >= 0.05


def test_an_insert_position_past_a_page_header_means_the_boundary() -> None:
    segment = 16 << 20
    # pg_switch_wal() on an idle primary: insert 0/4000028, a caught-up replica 0/4000000.
    assert comparable(parse_token("0/4000028")) == parse_token("0/4000000")
    # A page boundary inside a segment: past the short header.
    assert comparable(segment + 8192 + 24) == segment + 8192
    # Anything else is a record's end already, the long header's size included.
    assert comparable(segment + 8192 + 40) == segment + 8192 + 40
    assert comparable(segment + 8192 + 48) == segment + 8192 + 48
    assert comparable(parse_token("0/4000000")) == parse_token("0/4000000")


async def test_an_idle_primary_past_a_wal_switch_keeps_its_replica_in_rotation() -> None:
    clock = Clock()
    primary = FakePool(parse_token("0/4000028"))
    replica = FakePool(parse_token("0/4000000"))
    rot = rotation(primary, {"r": replica}, clock=clock, max_lag=1.0)
    for second in range(5):
        clock.now = float(second)
        await rot.check()
    view = rot.views()[0]
    assert view.lag_seconds == 0.0
    assert view.in_rotation
    # The primary's token at that moment is answered by the replica at once.
    target = await rot.choose(after=parse_token("0/4000028"))
    assert target.name == "r"


# --- a token the primary has not written (security review, issue 41) ----------------------


class GatedPool(FakePool):
    """A primary whose position reads wait until ``go`` is set (``asked`` is set by each)."""

    def __init__(self, position: int) -> None:
        super().__init__(position)
        self.asked = asyncio.Event()
        self.go = asyncio.Event()

    async def fetchval(self, query: str, *args: Any, timeout: float | None = None) -> int:  # noqa: ASYNC109
        self.asked.set()
        await self.go.wait()
        return await super().fetchval(query, *args, timeout=timeout)


async def test_a_token_past_the_primary_is_refused_without_waiting() -> None:
    primary = FakePool(500)
    rot = rotation(primary, {"r": FakePool(100)}, max_lag=3600, wait=30.0)
    await rot.check()
    reads = primary.reads
    with pytest.raises(SearchTokenAhead) as refused:
        await rot.choose(after=parse_token("FFFFFFFF/FFFFFFFF"))
    assert refused.value.code == "SEARCH_TOKEN_AHEAD"
    assert refused.value.http_status == 422
    assert primary.reads == reads + 1  # read once more before refusing
    # At or below what the primary had: no read.
    await rot.primary.check_written(500)
    assert primary.reads == reads + 1


async def test_a_token_minted_after_the_last_read_is_not_refused() -> None:
    primary = FakePool(500)
    replica = FakePool(700)
    rot = rotation(primary, {"r": replica}, max_lag=3600)
    await rot.check()
    primary.position = 800  # written since the check
    target = await rot.choose(after=790)
    assert target.name == PRIMARY  # no replica has it and no wait: the primary answers
    assert rot.primary.position == 800


async def test_searches_refused_at_once_share_one_read_started_after_they_came() -> None:
    primary = GatedPool(500)
    position = PrimaryPosition(primary, timeout_seconds=30)  # type: ignore[arg-type]
    checks = [asyncio.create_task(position.check_written(10_000)) for _ in range(5)]
    await primary.asked.wait()
    primary.asked.clear()
    late = asyncio.create_task(position.check_written(10_000))  # after the read started
    primary.go.set()
    for check in checks:
        with pytest.raises(SearchTokenAhead):
            await check
    with pytest.raises(SearchTokenAhead):
        await late
    assert primary.reads == 2  # one for the five, one started after the late one came


async def test_an_unreadable_primary_refuses_nothing() -> None:
    primary = FakePool(500)
    primary.down = True
    position = PrimaryPosition(primary, timeout_seconds=30)  # type: ignore[arg-type]
    await position.check_written(10_000)  # not known to be ahead: not refused


# --- the lag check when the primary cannot be read ------------------------------------------


async def test_a_round_without_the_primary_bounds_the_replicas_lag_by_the_last_good_one() -> None:
    clock = Clock()
    primary = FakePool(100)
    replica = FakePool(100)
    rot = rotation(primary, {"r": replica}, clock=clock, max_lag=1.0)
    await rot.check()
    assert rot.views()[0].in_rotation
    primary.down = True
    clock.now = 0.6
    await rot.check()  # does not raise
    view = rot.views()[0]
    assert view.in_rotation  # a blip within the limit
    assert view.lag_seconds == pytest.approx(0.6)
    clock.now = 1.5
    await rot.check()
    view = rot.views()[0]
    assert not view.in_rotation
    assert view.lag_seconds == pytest.approx(1.5)
    assert (await rot.choose()).name == PRIMARY
    primary.down = False
    clock.now = 2.0
    await rot.check()
    assert rot.views()[0].in_rotation


async def test_a_primary_never_read_keeps_every_replica_out() -> None:
    primary = FakePool(100)
    primary.down = True
    rot = rotation(primary, {"r": FakePool(100)})
    await rot.check()
    view = rot.views()[0]
    assert not view.in_rotation
    assert view.lag_seconds is None


async def test_the_choice_is_on_the_requests_span_and_only_a_wait_is_a_span() -> None:
    primary, replica = FakePool(500), FakePool(100)
    rot = rotation(primary, {"r": replica}, max_lag=3600, wait=0.05)
    await rot.check()
    with traced() as exported:
        with span_under("request", None):
            await rot.choose()
        with span_under("waiting request", None):
            await rot.choose(after=450)  # no replica replays it: waits, then the primary
        spans = exported.get_finished_spans()
    assert sorted(s.name for s in spans) == ["kb.search.after_wait", "request", "waiting request"]
    request, waiting = one(spans, "request"), one(spans, "waiting request")
    assert request.attributes == {"kb.search.server": "r", "kb.search.after": False}
    assert waiting.attributes is not None
    assert waiting.attributes["kb.search.server"] == PRIMARY
    assert waiting.attributes["kb.search.after"] is True
    assert float(str(waiting.attributes["kb.search.after_wait_seconds"])) >= 0.05
    assert parent_id(one(spans, "kb.search.after_wait")) == span_id(waiting)
