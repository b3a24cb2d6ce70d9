"""The second wall between tenants: PostgreSQL row security (migrations/0029).

A tenant-scoped transaction of the API starts with ``SET LOCAL ROLE kb_tenant_api`` and the
tenant in the transaction-local setting ``kb.tenant_id``; every tenant-scoped table's policy
then shows and accepts only that tenant's rows, whatever a statement's own filter says. Both
are LOCAL: they end with the transaction, committed or rolled back, so a pooled connection
never carries the role or the tenant into its next use, and the pools that skip asyncpg's
session reset (db.skip_session_reset) stay safe.

The statements are text for the simple query protocol, sent in the same round trip as the
transaction's BEGIN (the search's BEGIN, and ``tenant_transaction`` here): a parameter cannot
go there, so the tenant goes in as a literal -- only after it matched the tenant id pattern
(tenant_ids), which leaves no quote or backslash to escape.

What it costs search depends on one property of the database (BENCHMARKS.md, tenant wall).
Behind row security, PostgreSQL evaluates a statement's own conditions on a table before the
policy's only when their functions are LEAKPROOF, and uses an index only for such a
condition; the full-text match (``@@``, ``ts_match_vq``) is not marked so by PostgreSQL, so
behind the wall the keyword list cannot start from its GIN index, and a keyword or hybrid
search of a principal who may read most of the tenant costs 1.3-1.5x at p95. Only a superuser
can mark it (migration 0029 does, per database, when it runs as one); on managed PostgreSQL
it stays unmarked, and ``auto`` leaves search outside the wall there (the publisher's paths
use no such condition and stay behind it).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator
from typing import Any, Final, Literal

from services.runtime.logging import get_logger
from services.runtime.pg.sql import queries_beside
from services.runtime.tenancy.tenant_ids import TENANT_ID_PATTERN

_QUERIES = queries_beside(__file__, "tenant_wall.sql")

log = get_logger(__name__)

# KB_DB_ROW_SECURITY (services/runtime/settings.py).
RowSecurity = Literal["auto", "on", "off"]

# The role the API's tenant paths run as, and the setting its policies read (migration 0029).
TENANT_ROLE: Final = "kb_tenant_api"
TENANT_SETTING: Final = "kb.tenant_id"

_TENANT_ID: Final = re.compile(TENANT_ID_PATTERN)


def walls_the_publisher(setting: RowSecurity) -> bool:
    """Whether the publisher's transactions and a tenant's status reads go behind the wall:
    they cost it no plan (no condition of theirs needs to be leakproof)."""
    return setting != "off"


async def walls_search(conn: Any, setting: RowSecurity) -> bool:
    """Whether search's transactions go behind the wall: ``on``/``off`` as said; ``auto``,
    when the full-text match is LEAKPROOF in the database (read once on ``conn``, outside
    any transaction of the caller's)."""
    if setting != "auto":
        return setting == "on"
    leakproof = await full_text_match_is_leakproof(conn)
    if not leakproof:
        log.warning(
            "tenant_wall.search_outside",
            reason="ts_match_vq is not LEAKPROOF in this database",
            setting="auto",
        )
    return leakproof


async def full_text_match_is_leakproof(conn: Any) -> bool:
    """Whether ``tsvector @@ tsquery`` may use its index behind the wall (module doc)."""
    return bool(await conn.fetchval(_QUERIES["full_text_match_is_leakproof"]))


def tenant_wall_sql(tenant_id: str) -> str:
    """The statements that put the rest of the open transaction behind the wall for
    ``tenant_id``. ValueError for a text that is not a tenant id (it never reaches SQL)."""
    if not _TENANT_ID.fullmatch(tenant_id):
        raise ValueError(f"{tenant_id!r} is not a tenant id")
    return f"SET LOCAL ROLE {TENANT_ROLE};SET LOCAL {TENANT_SETTING} = '{tenant_id}';"


def begin_sql(tenant_id: str, *, row_security: bool, read_only: bool = False) -> str:
    """BEGIN, then the wall when ``row_security``: one round trip."""
    begin = "BEGIN READ ONLY;" if read_only else "BEGIN;"
    return begin + (tenant_wall_sql(tenant_id) if row_security else "")


@contextlib.asynccontextmanager
async def tenant_transaction(
    conn: Any, tenant_id: str, *, row_security: bool, read_only: bool = False
) -> AsyncIterator[None]:
    """A transaction on ``conn`` (asyncpg connection or pool proxy) behind the wall for
    ``tenant_id`` (``row_security`` False: an ordinary transaction), committed when the block
    ends, rolled back when it raises. The caller translates driver errors."""
    await conn.execute(begin_sql(tenant_id, row_security=row_security, read_only=read_only))
    try:
        yield
    except BaseException:
        # A connection broken meanwhile cannot roll back; the pool discards it.
        with contextlib.suppress(Exception):
            await conn.execute("ROLLBACK")
        raise
    await conn.execute("COMMIT")
