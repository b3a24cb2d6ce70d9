"""The limiter's arithmetic (GCRA with reservations), without a store or a clock."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

import pytest

from services.embedding.guard.quota import (
    INDEXING_REQUESTS,
    INDEXING_TOKENS,
    REQUESTS,
    TOKENS,
    Bucket,
    Charge,
    Purpose,
    QuotaPlan,
    paused_tats,
    reserve,
    send_time,
)

T0 = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


class Buckets:
    """The tats a store would keep, reserved on one after another."""

    def __init__(self) -> None:
        self.tats: dict[str, datetime] = {}
        self.paused_until: datetime | None = None

    def send(self, now: datetime, charges: Sequence[Charge], max_wait: float = 1e9) -> float:
        reservation = reserve(now, self.paused_until, self.tats, charges, max_wait_seconds=max_wait)
        assert reservation.granted
        self.tats.update(reservation.tats)
        return (reservation.send_at - T0).total_seconds()


def test_requests_are_spaced_one_period_apart() -> None:
    bucket = Bucket("requests", rate=10, burst=1)
    buckets = Buckets()
    sends = [buckets.send(T0, [Charge(bucket, 1)]) for _ in range(5)]
    assert sends == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4])


def test_a_burst_goes_at_once_then_the_rate_holds() -> None:
    bucket = Bucket("requests", rate=10, burst=5)
    buckets = Buckets()
    sends = [buckets.send(T0, [Charge(bucket, 1)]) for _ in range(7)]
    assert sends == pytest.approx([0, 0, 0, 0, 0, 0.1, 0.2])
    # After a quiet second the burst is back.
    assert [buckets.send(at(2), [Charge(bucket, 1)]) for _ in range(6)] == pytest.approx(
        [2, 2, 2, 2, 2, 2.1]
    )


def test_a_request_costlier_than_the_burst_goes_when_the_bucket_is_idle() -> None:
    tokens = Bucket("tokens", rate=100, burst=10)
    buckets = Buckets()
    assert buckets.send(T0, [Charge(tokens, 50)]) == 0.0
    # ... and the bucket owes all of it: the next request waits for 50 tokens' time.
    assert buckets.send(T0, [Charge(tokens, 10)]) == pytest.approx(0.5)


def test_a_request_waiting_too_long_reserves_nothing() -> None:
    bucket = Bucket("requests", rate=1, burst=1)
    buckets = Buckets()
    buckets.send(T0, [Charge(bucket, 1)])
    buckets.send(T0, [Charge(bucket, 1)])
    before = dict(buckets.tats)
    refused = reserve(T0, None, buckets.tats, [Charge(bucket, 1)], max_wait_seconds=1.5)
    assert not refused.granted
    assert refused.wait_seconds == pytest.approx(2.0)
    assert refused.tats == {}
    assert buckets.tats == before


def test_the_slowest_bucket_decides() -> None:
    requests = Bucket("requests", rate=10, burst=1)
    tokens = Bucket("tokens", rate=100, burst=100)
    buckets = Buckets()
    charges = [Charge(requests, 1), Charge(tokens, 100)]
    # 100 tokens per request at 100 tokens/s: the tokens bucket spaces them one second.
    assert [buckets.send(T0, charges) for _ in range(3)] == pytest.approx([0, 1, 2])
    # Both buckets owe what the request cost from its send time.
    assert buckets.tats["requests"] == at(2.1)
    assert buckets.tats["tokens"] == at(3)


def test_nothing_is_sent_before_the_pause_ends() -> None:
    bucket = Bucket("requests", rate=10, burst=5)
    assert send_time(T0, at(3), {}, [Charge(bucket, 1)]) == at(3)
    assert send_time(T0, at(-3), {}, [Charge(bucket, 1)]) == T0
    assert send_time(T0, at(3), {}, []) == at(3)


def test_a_pause_moves_every_known_bucket_so_requests_resume_spaced() -> None:
    plan = QuotaPlan(requests_per_second=10, burst_seconds=0.5)  # burst 5 requests
    requests = plan.bucket(REQUESTS)
    assert requests is not None
    buckets = Buckets()
    buckets.send(T0, [Charge(requests, 1)])
    buckets.tats["someone-elses"] = T0
    buckets.paused_until = at(10)
    moved = paused_tats(buckets.tats, at(10), plan)
    assert moved == {REQUESTS: at(10.5)}  # paused_until + tau; an unknown bucket untouched
    buckets.tats.update(moved)
    # Without the move, five requests would go at 10 at once: now one period apart.
    sends = [buckets.send(at(1), [Charge(requests, 1)]) for _ in range(3)]
    assert sends == pytest.approx([10.1, 10.2, 10.3])
    # A bucket already owing more than that keeps its debt.
    assert paused_tats({REQUESTS: at(20)}, at(10), plan) == {REQUESTS: at(20)}


def test_indexing_takes_its_share_and_queries_only_the_totals() -> None:
    plan = QuotaPlan(requests_per_second=10, tokens_per_second=1000, query_reserve=0.2)
    index = {charge.bucket.name: charge for charge in plan.charges(Purpose.INDEX, 40)}
    query = {charge.bucket.name: charge for charge in plan.charges(Purpose.QUERY, 40)}
    assert set(index) == {REQUESTS, TOKENS, INDEXING_REQUESTS, INDEXING_TOKENS}
    assert set(query) == {REQUESTS, TOKENS}
    assert index[INDEXING_REQUESTS].bucket.rate == pytest.approx(8)
    assert index[INDEXING_TOKENS].bucket.rate == pytest.approx(800)
    assert (index[TOKENS].cost, index[REQUESTS].cost) == (40, 1)

    # A backfill saturates the indexing share; a query still goes at once.
    buckets = Buckets()
    index_charges = plan.charges(Purpose.INDEX, 1)
    index_sends = [buckets.send(T0, index_charges) for _ in range(20)]
    assert index_sends[-1] > 1.0
    assert buckets.send(T0, plan.charges(Purpose.QUERY, 1)) < index_sends[-1]
    query_send = buckets.send(T0, plan.charges(Purpose.QUERY, 1))
    next_index = buckets.send(T0, index_charges)
    assert query_send < next_index


def test_no_reserve_means_no_indexing_buckets_and_no_rate_no_charge() -> None:
    plan = QuotaPlan(requests_per_second=10, query_reserve=0)
    assert [c.bucket.name for c in plan.charges(Purpose.INDEX, 5)] == [REQUESTS]
    assert QuotaPlan().charges(Purpose.INDEX, 5) == []
    assert not QuotaPlan().limits
    # A request with no tokens counted charges no token bucket.
    assert [c.bucket.name for c in QuotaPlan(tokens_per_second=5).charges(Purpose.QUERY, 0)] == []


def test_a_tenant_share_is_a_bucket_of_its_own_at_its_share_of_the_token_rate() -> None:
    plan = QuotaPlan(tokens_per_second=100, tenant_share=0.25, burst_seconds=1)
    acme = plan.tenant_charge("acme", 50)
    assert acme is not None
    assert acme.bucket.name == "tenant:acme:tokens"
    assert acme.bucket.rate == pytest.approx(25)
    assert plan.bucket("tenant:acme:tokens") == acme.bucket
    buckets = Buckets()
    assert buckets.send(T0, [acme]) == 0.0
    # 50 tokens are 2 s of acme's share (more than its burst of 25): the next 50 wait for
    # them. Another tenant's share is untouched.
    assert buckets.send(T0, [acme]) == pytest.approx(2.0)
    globex = plan.tenant_charge("globex", 50)
    assert globex is not None
    assert buckets.send(T0, [globex]) == 0.0
    assert QuotaPlan(tokens_per_second=100).tenant_charge("acme", 50) is None
    assert QuotaPlan(tenant_share=0.5).tenant_charge("acme", 50) is None


def test_the_burst_is_at_least_one_request() -> None:
    plan = QuotaPlan(requests_per_second=0.5, burst_seconds=1)
    bucket = plan.bucket(REQUESTS)
    assert bucket is not None
    assert bucket.burst == 1.0


@pytest.mark.parametrize(
    "options",
    [{"query_reserve": 1.0}, {"query_reserve": -0.1}, {"tenant_share": 0}, {"burst_seconds": 0}],
)
def test_a_plan_refuses_nonsense(options: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(options))):
        QuotaPlan(**options)
