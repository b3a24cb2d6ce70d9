"""asyncpg pool and the translation of driver errors into the domain error tree.

Only adapters import this module; domain code sees :mod:`services.runtime.errors` only.
"""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import AsyncIterator, Iterator
from typing import Any

import asyncpg
from pgvector.asyncpg import register_vector

from services.runtime.errors import (
    ConfigError,
    Conflict,
    DatabaseBusy,
    DatabaseUnavailable,
    KbError,
    SerializationConflict,
)
from services.runtime.pg.sql import queries_beside
from services.runtime.pg.tls_files import check_tls_files
from services.runtime.settings import RuntimeSettings

_QUERIES = queries_beside(__file__, "db.sql")


class DatabaseError(KbError):
    code = "DATABASE_ERROR"


async def _init_connection(conn: asyncpg.Connection[Any]) -> None:
    # The vector type exists only after the first migration; a pool opened before it
    # (``kb migrate`` itself, /readyz on an empty database) simply has no vector codec.
    if await conn.fetchval(_QUERIES["vector_type_exists"]):
        await register_vector(conn)


async def skip_session_reset(conn: asyncpg.Connection[Any]) -> None:
    """``reset=`` for a pool whose users set no session state (no SET, LISTEN, session-level
    advisory lock or cursor: settings go with SET LOCAL): only a transaction left open is
    undone. asyncpg's default runs ``RESET ALL; UNLISTEN *; ...`` on every release, one more
    round trip per use of a connection (the indexer's claim->complete: a third of its cost;
    a search: one per connection it read on). asyncpg (0.32) rolls back a transaction left
    open before it calls this; the ROLLBACK here keeps that true whatever it does."""
    if conn.is_in_transaction():
        await conn.execute(_QUERIES["rollback"])


async def create_pool(settings: RuntimeSettings, **overrides: Any) -> asyncpg.Pool[Any]:
    options: dict[str, Any] = {
        "min_size": settings.db_pool_min_size,
        "max_size": settings.db_pool_max_size,
        "init": _init_connection,
        "server_settings": {
            "application_name": "kb-pipeline",
            "statement_timeout": str(settings.db_statement_timeout_ms),
        },
    }
    options.update(overrides)
    # Before connecting: a TLS file the URL names but that is missing would fail like a
    # server that is away, and be waited for for ever (services/runtime/pg/tls_files.py).
    check_tls_files(settings.database_url)
    with translate_db_errors():
        pool = await asyncpg.create_pool(settings.database_url, **options)
    assert pool is not None
    return pool


async def create_pool_without_session_reset(
    settings: RuntimeSettings, **overrides: Any
) -> asyncpg.Pool[Any]:
    """A pool whose released connections are not reset (``skip_session_reset``): for the
    pools whose every user keeps its settings and locks inside transactions."""
    return await create_pool(settings, **{"reset": skip_session_reset, **overrides})


async def connect(settings: RuntimeSettings) -> asyncpg.Connection[Any]:
    check_tls_files(settings.database_url)
    with translate_db_errors():
        conn: asyncpg.Connection[Any] = await asyncpg.connect(settings.database_url)
    await _init_connection(conn)
    return conn


@contextlib.asynccontextmanager
async def connection(settings: RuntimeSettings) -> AsyncIterator[asyncpg.Connection[Any]]:
    conn = await connect(settings)
    try:
        yield conn
    finally:
        await conn.close()


@contextlib.contextmanager
def translate_db_errors() -> Iterator[None]:
    """Map asyncpg/OS errors to domain errors. Adapters wrap their calls in this."""
    try:
        yield
    except KbError:
        raise
    except asyncpg.ClientConfigurationError as exc:
        raise ConfigError(f"database configuration: {exc}") from exc
    except ssl.SSLCertVerificationError as exc:
        # An OSError too, but retrying never makes the server's certificate verify: a
        # process waiting for the database must stop and say why (a wrong CA, a wrong host).
        raise ConfigError(f"database certificate not verified: {exc}") from exc
    except (asyncpg.SerializationError, asyncpg.DeadlockDetectedError) as exc:
        raise SerializationConflict(str(exc)) from exc
    except asyncpg.UniqueViolationError as exc:
        raise Conflict(
            f"unique constraint {exc.constraint_name} violated", code="UNIQUE_VIOLATION"
        ) from exc
    except (
        asyncpg.PostgresConnectionError,
        asyncpg.CannotConnectNowError,
        asyncpg.TooManyConnectionsError,
        asyncpg.InterfaceError,
        ConnectionError,
        OSError,
        TimeoutError,
    ) as exc:
        raise DatabaseUnavailable(f"database unreachable: {exc}") from exc
    # Transient server-side conditions: retriable, never the permanent DatabaseError below.
    # Connected, but this statement could not finish now: statement_timeout or a cancel
    # (57014), lock_timeout / NOWAIT (55P03), a transaction or idle-in-transaction timeout
    # (25P03, 25P04), out of memory or disk (53xxx).
    except (
        asyncpg.QueryCanceledError,
        asyncpg.LockNotAvailableError,
        asyncpg.IdleInTransactionSessionTimeoutError,
        asyncpg.TransactionTimeoutError,
        asyncpg.InsufficientResourcesError,
    ) as exc:
        raise DatabaseBusy(f"{type(exc).__name__}: {exc}") from exc
    # The server, or a writable primary, is gone for now: an operator or crash shut the
    # backend down (57P01, 57P02, other 57xxx), or after a failover we are connected to a
    # read-only standby (25006). A reconnect or the promotion fixes it.
    except (asyncpg.OperatorInterventionError, asyncpg.ReadOnlySQLTransactionError) as exc:
        raise DatabaseUnavailable(f"{type(exc).__name__}: {exc}") from exc
    # asyncpg's own connection state gone wrong ("cannot switch to state 12; another
    # operation (2) is in progress"): seen on a pooled connection while the pool restored its
    # floor during a PostgreSQL restart (the chaos run, RELIABILITY.md). Retried like the
    # restart itself, by the loops that retry DATABASE_UNAVAILABLE; a process that exited on
    # it (the relay did) would not recover by itself.
    except asyncpg.InternalClientError as exc:
        raise DatabaseUnavailable(f"{type(exc).__name__}: {exc}") from exc
    except asyncpg.PostgresError as exc:
        raise DatabaseError(f"{type(exc).__name__}: {exc}") from exc
