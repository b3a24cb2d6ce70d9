"""`kb ingest run|replay-dead --tier T` and `kb tenants ingest-keys add|list|revoke`
(docs/architecture.md#publish-by-event, docs/security.md#publish-by-event). Drivers are
imported inside the commands, so `kb --help` does not pay for them."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import os
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from services.publisher.keys.cli import TENANT_ARG, check_tenant, run_with_connection
from services.runtime.commands.cli_options import metrics_port_option, serve_metrics
from services.runtime.errors import BadInput

if TYPE_CHECKING:
    from aiokafka import AIOKafkaConsumer

    from services.publisher.ingest.consumer_kafka import KafkaDeadLetters
    from services.publisher.ingest.settings import IngestSettings
    from services.runtime.backoff import Backoff

app = typer.Typer(help="Apply producers' signed commands from Kafka.", no_args_is_help=True)
ingest_keys_app = typer.Typer(
    help="The Ed25519 keys a tenant's producers sign ingest commands with.", no_args_is_help=True
)

# TEST ONLY: when set to a file path, `kb ingest run` writes how many records its first
# batch applied to that file and then hangs *before* committing their offsets, so a test can
# kill -9 it exactly between the commands' transactions and the offset commit. Never set it
# in production.
TEST_ONLY_HANG_BEFORE_COMMIT = "KB_INGEST_TEST_ONLY_HANG_BEFORE_COMMIT"

TIER_OPTION = typer.Option(..., "--tier", help="The tier whose ingest topic to consume.")
TIER_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,31}$"


def _tier(tier: str) -> str:
    if not re.fullmatch(TIER_PATTERN, tier):
        raise BadInput(f"tier {tier!r} is invalid", code="TIER_INVALID")
    return tier


@app.command("run")
def run(
    tier: str = TIER_OPTION,
    metrics_port: int | None = metrics_port_option(
        "Serve Prometheus /metrics on PORT (default KB_INGEST_METRICS_PORT)."
    ),
) -> None:
    """Consume kb.ingest.<tier> in the group kb-ingest.<tier> until SIGTERM/SIGINT (add
    processes to scale out)."""
    from services.publisher.ingest.settings import IngestSettings
    from services.runtime.commands.cli_support import load_settings, run_async
    from services.runtime.logging import configure_logging
    from services.runtime.signals import run_until_signalled

    _tier(tier)
    settings = load_settings(IngestSettings)
    configure_logging(settings.log_level, settings.log_format, service="kb-ingest")
    port = metrics_port if metrics_port is not None else settings.ingest_metrics_port
    serve_metrics(port, settings.ingest_metrics_host)
    run_async(run_until_signalled(lambda stop: _consume(settings, tier, stop, replay=False)))


@app.command("replay-dead")
def replay_dead(tier: str = TIER_OPTION) -> None:
    """Apply the dead letters of kb.ingest-dead.<tier> again (once their cause is fixed: a
    key registered, a document uploaded), up to the end the topic has now; those that
    still fail are dead-lettered again, after that end. Prints how many were read."""
    from services.publisher.ingest.settings import IngestSettings
    from services.runtime.commands.cli_support import load_settings, run_async
    from services.runtime.logging import configure_logging
    from services.runtime.signals import run_until_signalled

    _tier(tier)
    settings = load_settings(IngestSettings)
    configure_logging(settings.log_level, settings.log_format, service="kb-ingest")
    done = run_async(run_until_signalled(lambda stop: _consume(settings, tier, stop, replay=True)))
    typer.echo(f"replayed={done}")


async def _consume(
    settings: IngestSettings, tier: str, stop: asyncio.Event, *, replay: bool
) -> int:
    from aiokafka import AIOKafkaConsumer

    from services.publisher.ingest.consumer_kafka import create_topics, start_when_reachable
    from services.publisher.ingest.pipeline import IngestLoop, pace_of
    from services.publisher.ingest.retention import IngestRetention
    from services.runtime.backoff import Backoff
    from services.runtime.logging import get_logger
    from services.runtime.messaging.events import (
        ingest_consumer_group,
        ingest_dead_topic,
        ingest_topic,
    )
    from services.runtime.messaging.kafka import kafka_client_kwargs

    prefix = settings.kafka_topic_prefix
    source, dead = ingest_topic(tier, prefix), ingest_dead_topic(tier, prefix)
    if settings.ingest_create_topics:
        await create_topics(settings, [source, dead])
    group = prefix + ingest_consumer_group(tier) + (".replay" if replay else "")
    consumer = AIOKafkaConsumer(
        dead if replay else source,
        group_id=group,
        enable_auto_commit=False,
        # A new group starts at the beginning: commands sent before the first consumer ran
        # are commands all the same.
        auto_offset_reset="earliest",
        max_partition_fetch_bytes=settings.ingest_max_command_bytes + 64 * 1024,
        fetch_max_bytes=max(52_428_800, settings.ingest_max_command_bytes * 2),
        **kafka_client_kwargs(settings),
    )
    backoff = Backoff(settings.ingest_backoff_initial_seconds, settings.ingest_backoff_max_seconds)
    async with _processing(settings, tier, stop, backoff, wait=not replay) as processor:
        try:
            if processor is None or not await start_when_reachable(
                consumer.start, stop, backoff, client="consumer"
            ):
                return 0  # stopped before the broker was reached
            loop = IngestLoop(
                consumer,
                processor,
                tier=tier,
                metrics=_metrics(),
                backoff=backoff,
                pace=pace_of(settings),
                reports=processor.store,
                before_commit=_hang_before_commit(),
            )
            get_logger(__name__).info("ingest.started", tier=tier, group=group, replay=replay)
            if replay:
                return await loop.run(stop, until_end=await _ends(consumer, stop))
            retention = IngestRetention(
                processor.store,
                refusal_days=settings.ingest_refusal_retention_days,
                command_days=settings.ingest_command_retention_days,
            )
            beside = asyncio.create_task(retention.run(stop))
            try:
                return await loop.run(stop)
            finally:
                beside.cancel()
                await asyncio.gather(beside, return_exceptions=True)
        finally:
            await consumer.stop()


def _hang_before_commit() -> Callable[[int], Awaitable[None]] | None:
    path = os.environ.get(TEST_ONLY_HANG_BEFORE_COMMIT)
    if not path:
        return None

    async def hang(done: int) -> None:
        partial = Path(path).with_suffix(".partial")
        partial.write_text(str(done))
        partial.rename(path)
        await asyncio.Event().wait()  # until killed

    return hang


async def _ends(consumer: AIOKafkaConsumer, stop: asyncio.Event) -> dict[Any, int]:
    """The dead-letter topic's end offsets once the group assigned its partitions."""
    while not consumer.assignment() and not stop.is_set():
        await consumer.getmany(timeout_ms=200, max_records=1)
        for tp in consumer.assignment():
            # getmany may have fetched past the committed position: read from it again.
            committed = await consumer.committed(tp)
            if committed is None:
                await consumer.seek_to_beginning(tp)
            else:
                consumer.seek(tp, committed)
    ends: dict[Any, int] = await consumer.end_offsets(list(consumer.assignment()))
    return ends


@functools.cache
def _metrics() -> Any:
    """The process's counters, registered once (a replay and a run share the names)."""
    from services.publisher.ingest.metrics import IngestMetrics

    return IngestMetrics()


@contextlib.asynccontextmanager
async def _processing(
    settings: IngestSettings, tier: str, stop: asyncio.Event, backoff: Backoff, *, wait: bool
) -> AsyncIterator[Any]:
    """The record processor: the store on its pool, the publisher, the dead-letter producer
    (None when stopped before the database or the broker was reached). With ``wait`` (the
    long-running consumer) an unreachable database is waited for, as the indexer does;
    without it (a replay, a short command) it fails at once."""
    from services.publisher.domain import Publisher
    from services.publisher.ingest.apply import IngestApplier
    from services.publisher.ingest.consumer_kafka import KafkaDeadLetters, start_when_reachable
    from services.publisher.ingest.process import IngestLimits, RecordProcessor
    from services.publisher.ingest.runs import RunApplier
    from services.publisher.ingest.store_pg import PgIngestStore
    from services.publisher.store_pg import open_publisher_pool
    from services.runtime.erasure.erase_pg import PgErasureStore
    from services.runtime.pg.waiting import StoppedWaiting, when_available
    from services.runtime.tenancy.tenant_wall import walls_the_publisher

    def open_pool() -> Awaitable[Any]:
        return open_publisher_pool(settings)

    try:
        if wait:
            pool = await when_available("open_pool", open_pool, stop=stop, backoff=backoff)
        else:
            pool = await open_pool()
    except StoppedWaiting:
        yield None
        return
    dead_letters: KafkaDeadLetters = KafkaDeadLetters(settings, tier)
    try:
        if not await start_when_reachable(dead_letters.start, stop, backoff, client="dead"):
            yield None
            return
        store = PgIngestStore(
            pool,
            acquire_timeout_seconds=settings.publisher_db_acquire_timeout_seconds,
            row_security=walls_the_publisher(settings.db_row_security),
        )
        publisher = Publisher(
            store,
            max_upload_bytes=settings.publisher_max_upload_bytes,
            erasure=PgErasureStore(pool),
            erase_batch_rows=settings.publisher_erase_batch_rows,
        )
        processor = RecordProcessor(
            tier,
            store,
            RunApplier(
                IngestApplier(
                    publisher, store, max_upload_bytes=settings.publisher_max_upload_bytes
                ),
                store,
            ),
            dead_letters,
            _metrics(),
            IngestLimits(
                settings.ingest_max_command_bytes,
                settings.ingest_max_inline_bytes,
                settings.ingest_tenant_in_flight,
                settings.ingest_key_cache_seconds,
            ),
        )
        yield processor
    finally:
        await dead_letters.close()
        await pool.close()


# --- kb tenants ingest-keys ---------------------------------------------------------------


@ingest_keys_app.command("add")
def add_key(
    tenant: str = TENANT_ARG,
    key_id: str = typer.Argument(help="The key's id, named by the kb-key-id header."),
    public_key: str = typer.Option(
        ..., "--public-key", help="The Ed25519 public key: its 32 raw bytes in base64."
    ),
) -> None:
    """Register a public key the tenant's producers sign commands with."""
    from services.publisher.ingest.signing import check_key_id, decode_public_key
    from services.publisher.ingest.store_pg import PgIngestKeys

    check_tenant(tenant)
    raw = decode_public_key(public_key)
    check_key_id(key_id)
    created = run_with_connection(lambda conn: PgIngestKeys(conn).add(tenant, key_id, raw))
    if created is None:
        # Exit 2 (the operator picks another id), where the API answers 409.
        raise BadInput(f"tenant {tenant!r} has a key {key_id!r} already", code="INGEST_KEY_EXISTS")
    typer.echo(f"added {key_id}")


@ingest_keys_app.command("list")
def list_keys(tenant: str = TENANT_ARG) -> None:
    """The tenant's ingest keys: id, public key (base64), added, revoked."""
    from services.publisher.ingest.store_pg import PgIngestKeys

    check_tenant(tenant)
    for row in run_with_connection(lambda conn: PgIngestKeys(conn).list(tenant)):
        encoded = base64.b64encode(bytes(row["public_key"])).decode()
        typer.echo(f"{row['key_id']}\t{encoded}\t{row['created_at']}\t{row['revoked_at'] or '-'}")


@ingest_keys_app.command("revoke")
def revoke_key(
    tenant: str = TENANT_ARG, key_id: str = typer.Argument(help="The key's id.")
) -> None:
    """Revoke a key at once: commands signed with it go to the dead-letter topic."""
    from services.publisher.ingest.signing import IngestKeyNotFound
    from services.publisher.ingest.store_pg import PgIngestKeys

    check_tenant(tenant)
    revoked = run_with_connection(lambda conn: PgIngestKeys(conn).revoke(tenant, key_id))
    if revoked is None:
        raise IngestKeyNotFound(f"tenant {tenant!r} has no live key {key_id!r}")
    typer.echo(f"revoked {key_id}")
