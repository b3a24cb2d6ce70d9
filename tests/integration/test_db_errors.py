"""translate_db_errors: which driver errors are transient (retriable) and which are not.

The mapping itself is checked on the asyncpg exception classes; the conditions that matter
most in production (a statement or lock timeout, a write on a read-only transaction as
after a failover) are then provoked on a real PostgreSQL."""

from __future__ import annotations

import ssl
from typing import Any

import asyncpg
import pytest

from services.runtime.errors import (
    ConfigError,
    Conflict,
    DatabaseBusy,
    DatabaseUnavailable,
    KbError,
    SerializationConflict,
)
from services.runtime.pg.db import DatabaseError, translate_db_errors

MAPPING: list[tuple[Exception, type[KbError], str, bool]] = [
    # Connected, but this statement could not finish now: retry later.
    (
        asyncpg.QueryCanceledError("canceling statement due to statement timeout"),
        DatabaseBusy,
        "DATABASE_BUSY",
        True,
    ),
    (
        asyncpg.LockNotAvailableError("canceling statement due to lock timeout"),
        DatabaseBusy,
        "DATABASE_BUSY",
        True,
    ),
    (
        asyncpg.IdleInTransactionSessionTimeoutError("idle-in-transaction timeout"),
        DatabaseBusy,
        "DATABASE_BUSY",
        True,
    ),
    (asyncpg.TransactionTimeoutError("transaction timeout"), DatabaseBusy, "DATABASE_BUSY", True),
    (asyncpg.OutOfMemoryError("out of memory"), DatabaseBusy, "DATABASE_BUSY", True),
    (asyncpg.DiskFullError("could not extend file"), DatabaseBusy, "DATABASE_BUSY", True),
    # The server, or a writable primary, is gone for now: retry after reconnect/failover.
    (
        asyncpg.AdminShutdownError("terminating connection due to administrator command"),
        DatabaseUnavailable,
        "DATABASE_UNAVAILABLE",
        True,
    ),
    (
        asyncpg.CrashShutdownError("terminating connection due to crash of another process"),
        DatabaseUnavailable,
        "DATABASE_UNAVAILABLE",
        True,
    ),
    (
        asyncpg.OperatorInterventionError("operator intervention"),
        DatabaseUnavailable,
        "DATABASE_UNAVAILABLE",
        True,
    ),
    (
        asyncpg.ReadOnlySQLTransactionError("cannot execute UPDATE in a read-only transaction"),
        DatabaseUnavailable,
        "DATABASE_UNAVAILABLE",
        True,
    ),
    (
        asyncpg.CannotConnectNowError("the database system is starting up"),
        DatabaseUnavailable,
        "DATABASE_UNAVAILABLE",
        True,
    ),
    (
        asyncpg.TooManyConnectionsError("too many clients"),
        DatabaseUnavailable,
        "DATABASE_UNAVAILABLE",
        True,
    ),
    (
        asyncpg.ConnectionDoesNotExistError("connection was closed"),
        DatabaseUnavailable,
        "DATABASE_UNAVAILABLE",
        True,
    ),
    (ConnectionRefusedError("refused"), DatabaseUnavailable, "DATABASE_UNAVAILABLE", True),
    (
        asyncpg.InternalClientError(
            "cannot switch to state 12; another operation (2) is in progress"
        ),
        DatabaseUnavailable,
        "DATABASE_UNAVAILABLE",
        True,
    ),
    # Unchanged: run it again / a conflict / the caller's configuration / a real error.
    (
        asyncpg.SerializationError("could not serialize access"),
        SerializationConflict,
        "SERIALIZATION_CONFLICT",
        True,
    ),
    (
        asyncpg.DeadlockDetectedError("deadlock"),
        SerializationConflict,
        "SERIALIZATION_CONFLICT",
        True,
    ),
    (asyncpg.UniqueViolationError("duplicate key"), Conflict, "UNIQUE_VIOLATION", False),
    (asyncpg.ClientConfigurationError("bad sslmode"), ConfigError, "CONFIG_INVALID", False),
    (
        ssl.SSLCertVerificationError("certificate verify failed: unable to get issuer"),
        ConfigError,
        "CONFIG_INVALID",
        False,
    ),
    (asyncpg.PostgresSyntaxError("syntax error"), DatabaseError, "DATABASE_ERROR", False),
    (asyncpg.UndefinedTableError("no such table"), DatabaseError, "DATABASE_ERROR", False),
    (asyncpg.CheckViolationError("check failed"), DatabaseError, "DATABASE_ERROR", False),
]


@pytest.mark.parametrize(
    ("raised", "domain", "code", "retriable"),
    MAPPING,
    ids=[type(raised).__name__ for raised, *_ in MAPPING],
)
def test_driver_errors_map_to_the_domain_tree(
    raised: Exception, domain: type[KbError], code: str, retriable: bool
) -> None:
    with pytest.raises(KbError) as caught, translate_db_errors():
        raise raised
    assert type(caught.value) is domain
    assert (caught.value.code, caught.value.retriable) == (code, retriable)
    assert caught.value.__cause__ is raised


def test_domain_errors_pass_through_untouched() -> None:
    original = DatabaseBusy("already translated")
    with pytest.raises(DatabaseBusy) as caught, translate_db_errors():
        raise original
    assert caught.value is original


@pytest.mark.integration
async def test_a_statement_timeout_is_busy_and_retriable(conn: asyncpg.Connection[Any]) -> None:
    with pytest.raises(DatabaseBusy) as caught, translate_db_errors():
        async with conn.transaction():
            await conn.execute("SET LOCAL statement_timeout = '50ms'")
            await conn.execute("SELECT pg_sleep(10)")
    assert caught.value.retriable
    assert isinstance(caught.value.__cause__, asyncpg.QueryCanceledError)


@pytest.mark.integration
async def test_a_lock_timeout_is_busy_and_retriable(
    conn: asyncpg.Connection[Any], database_url: str
) -> None:
    holder = await asyncpg.connect(database_url)
    try:
        async with holder.transaction():
            await holder.execute("LOCK TABLE index_task IN ACCESS EXCLUSIVE MODE")
            with pytest.raises(DatabaseBusy) as caught, translate_db_errors():
                async with conn.transaction():
                    await conn.execute("SET LOCAL lock_timeout = '50ms'")
                    await conn.fetchval("SELECT count(*) FROM index_task")
    finally:
        await holder.close()
    assert isinstance(caught.value.__cause__, asyncpg.LockNotAvailableError)


@pytest.mark.integration
async def test_a_write_on_a_read_only_transaction_is_unavailable_not_permanent(
    conn: asyncpg.Connection[Any],
) -> None:
    # What a primary that failed over to a read-only standby answers to every write.
    with pytest.raises(DatabaseUnavailable) as caught, translate_db_errors():
        async with conn.transaction(readonly=True):
            await conn.execute("UPDATE index_task SET updated_at = now()")
    assert caught.value.retriable
    assert isinstance(caught.value.__cause__, asyncpg.ReadOnlySQLTransactionError)


@pytest.mark.integration
async def test_a_broken_statement_stays_a_permanent_error(conn: asyncpg.Connection[Any]) -> None:
    with pytest.raises(DatabaseError) as caught, translate_db_errors():
        await conn.execute("SELECT no_such_column FROM index_task")
    assert not caught.value.retriable
