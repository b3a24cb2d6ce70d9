"""`kb relay run` and `kb relay replay`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

import typer

from services.relay.outbox_pg import PgLeaseStore, PgOutboxSource, PgWakeups, create_relay_pool
from services.relay.ports import Lease, OutboxRecord, ReplayFilter
from services.relay.relay import AfterAck, Relay
from services.relay.replay import ReplayResult, replay
from services.relay.settings import RelaySettings
from services.relay.sink_kafka import KafkaSink
from services.runtime.commands.cli_options import metrics_port_option, serve_metrics
from services.runtime.commands.cli_support import load_settings, run_async
from services.runtime.errors import BadInput
from services.runtime.indexing.search_lag import run_search_lag_sampler
from services.runtime.logging import configure_logging, get_logger
from services.runtime.pg.waiting import StoppedWaiting, when_available
from services.runtime.signals import run_until_signalled
from services.runtime.tracing.setup import configure_tracing

app = typer.Typer(help="Carry committed outbox rows to Kafka.", no_args_is_help=True)
log = get_logger(__name__)

# TEST ONLY: when set to a file path, `kb relay run` writes the event ids of the first batch
# Kafka acknowledged to that file and then hangs *before* recording progress, so a test can
# kill -9 it exactly between produce and progress commit. Never set it in production.
TEST_ONLY_PAUSE_AFTER_ACK = "KB_RELAY_TEST_ONLY_PAUSE_AFTER_ACK"


def _pause_after_ack_hook(path: Path) -> AfterAck:
    async def pause(lease: Lease, records: Sequence[OutboxRecord]) -> None:
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps([str(r.event_id) for r in records]))
        partial.rename(path)
        log.warning("relay.test_only_paused", partition=lease.partition, events=len(records))
        await asyncio.Event().wait()  # until killed

    return pause


@app.command("run")
def run(
    metrics_port: int | None = metrics_port_option(
        "Serve Prometheus /metrics on PORT (default KB_RELAY_METRICS_PORT)."
    ),
) -> None:
    """Run the relay until SIGTERM/SIGINT (several instances may run at once)."""
    settings = load_settings(RelaySettings)
    configure_logging(settings.log_level, settings.log_format, service="relay")
    configure_tracing("kb-relay")
    port = metrics_port if metrics_port is not None else settings.relay_metrics_port
    serve_metrics(port, settings.relay_metrics_host)
    pause_path = os.environ.get(TEST_ONLY_PAUSE_AFTER_ACK)
    hook = _pause_after_ack_hook(Path(pause_path)) if pause_path else None
    run_async(run_until_signalled(lambda stop: _run(settings, hook, stop)))


async def _run(settings: RelaySettings, hook: AfterAck | None, stop: asyncio.Event) -> None:
    # A database that is not up yet is waited for (database.unavailable, as every
    # long-running command logs it), not a crash loop.
    try:
        pool = await when_available(
            "open_pool", lambda: create_relay_pool(settings), stop=stop, backoff=settings.backoff()
        )
    except StoppedWaiting:
        log.info("relay.stopped_at_start")
        return
    relay = Relay(
        settings,
        leases=PgLeaseStore(pool),
        source=PgOutboxSource(pool),
        sink=KafkaSink(settings),
        wakeups=PgWakeups(settings),
        after_ack=hook,
    )
    # The search-version lag is exported by every long-running process with a pool.
    lag = asyncio.create_task(
        run_search_lag_sampler(pool, stop, interval_seconds=settings.relay_metrics_interval_seconds)
    )
    try:
        await relay.start()
        stopped = asyncio.create_task(relay.wait_stopped())
        signalled = asyncio.create_task(stop.wait())
        await asyncio.wait({stopped, signalled}, return_when=asyncio.FIRST_COMPLETED)
        signalled.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await signalled
    finally:
        lag.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await lag
        await relay.stop()
        await pool.close()
    if relay.failure is not None:
        raise relay.failure


@dataclass(frozen=True)
class ReplayArgs:
    where: ReplayFilter
    rate: float | None


def parse_replay_args(
    *,
    from_position: str | None,
    since: str | None,
    to: str | None,
    tenant: str | None,
    tier: str | None,
    event_type: str | None,
    rate: str | None,
) -> ReplayArgs:
    """Validate the command line; every mistake is a BadInput (exit 2) saying what to fix."""
    if (from_position is None) == (since is None):
        raise BadInput("give exactly one of --from POSITION or --since TIME")
    if from_position is not None:
        where = _position_range(from_position, to)
    else:
        assert since is not None
        where = _time_range(since, to)
    replay_rate = None if rate is None else _rate(rate)
    for name, value in (("--tenant", tenant), ("--tier", tier), ("--type", event_type)):
        if value is not None and not value.strip():
            raise BadInput(f"{name} must not be empty")
    where = replace(where, tenant_id=tenant, tier=tier, event_type=event_type)
    return ReplayArgs(where=where, rate=replay_rate)


def _position_range(from_position: str, to: str | None) -> ReplayFilter:
    start = _position("--from", from_position)
    up_to = None if to is None else _position("--to", to)
    if up_to is not None and up_to < start:
        raise BadInput(f"--to {up_to} is before --from {start}")
    return ReplayFilter(after_position=start - 1, up_to_position=up_to)


def _time_range(since: str, to: str | None) -> ReplayFilter:
    since_at = _time("--since", since)
    until = None if to is None else _time("--to", to)
    if until is not None and until <= since_at:
        raise BadInput(f"--to {to} is not after --since {since}")
    return ReplayFilter(since=since_at, until=until)


def _rate(rate: str) -> float:
    try:
        replay_rate = float(rate)
    except ValueError:
        raise BadInput(f"--rate must be a number of events per second, not {rate!r}") from None
    if not replay_rate > 0:
        raise BadInput(f"--rate must be greater than 0, not {rate!r}")
    return replay_rate


def _position(option: str, value: str) -> int:
    try:
        position = int(value)
    except ValueError:
        raise BadInput(f"{option} must be an outbox position (an integer), not {value!r}") from None
    if position < 1:
        raise BadInput(f"{option} must be a position >= 1, not {position}")
    return position


def _time(option: str, value: str) -> datetime:
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise BadInput(
            f"{option} must be an ISO 8601 time such as 2026-01-31T12:00:00Z, not {value!r}"
        ) from None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)


@app.command("replay")
def replay_command(
    from_position: str | None = typer.Option(
        None, "--from", help="First outbox position to re-send (inclusive)."
    ),
    since: str | None = typer.Option(
        None,
        "--since",
        help="Re-send rows created at or after this ISO 8601 time (UTC if no zone).",
    ),
    to: str | None = typer.Option(
        None,
        "--to",
        help="End of the range: a position (inclusive) with --from, a time (exclusive) with "
        "--since. Default: the last row there when the replay starts.",
    ),
    tenant: str | None = typer.Option(None, "--tenant", help="Only this tenant's events."),
    tier: str | None = typer.Option(None, "--tier", help="Only events of this tier."),
    event_type: str | None = typer.Option(None, "--type", help="Only this event type."),
    rate: str | None = typer.Option(None, "--rate", help="At most N events per second."),
) -> None:
    """Re-send a range of outbox rows to Kafka with the header replay=true."""
    args = parse_replay_args(
        from_position=from_position,
        since=since,
        to=to,
        tenant=tenant,
        tier=tier,
        event_type=event_type,
        rate=rate,
    )
    settings = load_settings(RelaySettings)
    configure_logging(settings.log_level, settings.log_format, service="relay-replay")
    result = run_async(_replay(settings, args))
    typer.echo(
        f"replayed {result.sent} events"
        + (f", last position {result.last_position}" if result.last_position else "")
    )


async def _replay(settings: RelaySettings, args: ReplayArgs) -> ReplayResult:
    pool = await create_relay_pool(settings, min_size=1, max_size=2)
    sink = KafkaSink(settings, client_id="kb-relay-replay")
    try:
        await sink.start()
        return await replay(
            PgOutboxSource(pool),
            sink,
            args.where,
            rate=args.rate,
            batch_size=settings.relay_batch_size,
            backoff=settings.backoff(),
        )
    finally:
        await sink.stop()
        await pool.close()
