"""`kb relay replay` argument validation: every mistake is BadInput (exit 2), clearly worded."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from services.relay.cli import parse_replay_args
from services.runtime.errors import BadInput


def _parse(**given: str) -> object:
    values: dict[str, str | None] = {
        "from_position": None,
        "since": None,
        "to": None,
        "tenant": None,
        "tier": None,
        "event_type": None,
        "rate": None,
    }
    values.update(given)
    return parse_replay_args(**values)


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({}, "exactly one of --from POSITION or --since TIME"),
        ({"from_position": "abc"}, "--from must be an outbox position"),
        ({"from_position": "0"}, "--from must be a position >= 1"),
        ({"from_position": "5", "since": "2026-01-01T00:00:00Z"}, "exactly one of"),
        ({"since": "yesterday"}, "--since must be an ISO 8601 time"),
        ({"from_position": "10", "to": "3"}, "--to 3 is before --from 10"),
        ({"from_position": "10", "to": "2026-01-01"}, "--to must be an outbox position"),
        ({"since": "2026-01-02", "to": "2026-01-01"}, "is not after --since"),
        ({"from_position": "1", "rate": "0"}, "--rate must be greater than 0"),
        ({"from_position": "1", "rate": "fast"}, "--rate must be a number"),
        ({"from_position": "1", "tenant": " "}, "--tenant must not be empty"),
    ],
)
def test_bad_input(given: dict[str, str], message: str) -> None:
    with pytest.raises(BadInput) as raised:
        _parse(**given)
    assert message in raised.value.message


def test_position_range_is_inclusive() -> None:
    args = parse_replay_args(
        from_position="10",
        since=None,
        to="20",
        tenant="acme",
        tier="gold",
        event_type="IndexTaskCreated",
        rate="50",
    )
    assert args.where.after_position == 9
    assert args.where.up_to_position == 20
    assert (args.where.tenant_id, args.where.tier, args.where.event_type) == (
        "acme",
        "gold",
        "IndexTaskCreated",
    )
    assert args.rate == 50.0


def test_times_without_a_zone_are_utc() -> None:
    args = parse_replay_args(
        from_position=None,
        since="2026-01-01T10:00:00",
        to="2026-01-01T12:00:00+01:00",
        tenant=None,
        tier=None,
        event_type=None,
        rate=None,
    )
    assert args.where.since == datetime(2026, 1, 1, 10, tzinfo=UTC)
    assert args.where.until == datetime(2026, 1, 1, 11, tzinfo=UTC)
