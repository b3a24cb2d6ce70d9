"""Plain, numbered SQL migrations applied under an advisory lock.

Each applied file is recorded with its SHA-256; an applied file that was edited later is
an error (the database would no longer be what the file says), never silently skipped.
Every file runs in its own transaction, together with its bookkeeping row.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg

from services.runtime.errors import MigrationChecksumMismatch, MigrationError
from services.runtime.pg.sql import queries_beside
from services.runtime.shipped import shipped_dir

_QUERIES = queries_beside(__file__, "migrations.sql")

# pg_advisory_lock key: any constant shared by every kb process; 'kbmigrat' in ASCII.
MIGRATION_LOCK_KEY = 0x6B626D6967726174
_FILENAME = re.compile(r"^(?P<version>\d{4})_(?P<name>[a-z0-9_]+)\.sql$")


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode("utf-8")).hexdigest()


def migrations_dir() -> Path:
    """``migrations/`` of a source checkout, else the copy packaged into the wheel."""
    return shipped_dir("migrations", MigrationError)


def load_migrations(directory: Path | None = None) -> list[Migration]:
    directory = directory or migrations_dir()
    found: list[Migration] = []
    for path in sorted(directory.glob("*.sql")):
        match = _FILENAME.match(path.name)
        if match is None:
            raise MigrationError(f"{path.name}: migration files are named NNNN_snake_case.sql")
        found.append(
            Migration(int(match["version"]), match["name"], path.read_text(encoding="utf-8"))
        )
    versions = [m.version for m in found]
    if len(set(versions)) != len(versions):
        raise MigrationError(f"two migration files share a number: {versions}")
    return found


@dataclass(frozen=True)
class MigrationReport:
    applied: list[Migration]
    already_applied: list[Migration]


async def apply_migrations(
    conn: asyncpg.Connection[Any], migrations: list[Migration] | None = None
) -> MigrationReport:
    migrations = load_migrations() if migrations is None else migrations
    # A session-level advisory lock serialises concurrent `kb migrate` runs (several pods
    # starting at once); the loser waits, then finds everything applied.
    await conn.execute(_QUERIES["lock_migrations"], MIGRATION_LOCK_KEY)
    try:
        await conn.execute(_QUERIES["create_bookkeeping"])
        recorded = {row["version"]: row for row in await conn.fetch(_QUERIES["applied_migrations"])}
        unknown = set(recorded) - {m.version for m in migrations}
        if unknown:
            raise MigrationError(
                f"the database has migrations this code does not know: {sorted(unknown)}"
            )
        applied: list[Migration] = []
        already: list[Migration] = []
        for migration in migrations:
            row = recorded.get(migration.version)
            if row is not None:
                if row["checksum"] != migration.checksum:
                    raise MigrationChecksumMismatch(
                        f"migration {migration.version:04d}_{migration.name} was edited after "
                        "it was applied; add a new migration instead"
                    )
                already.append(migration)
                continue
            async with conn.transaction():
                await conn.execute(migration.sql)
                await conn.execute(
                    _QUERIES["record_migration"],
                    migration.version,
                    migration.name,
                    migration.checksum,
                )
            applied.append(migration)
        return MigrationReport(applied=applied, already_applied=already)
    finally:
        await conn.execute(_QUERIES["unlock_migrations"], MIGRATION_LOCK_KEY)


async def pending_migrations(conn: asyncpg.Connection[Any]) -> list[Migration]:
    """Migrations not yet applied (for readiness checks); all of them on an empty database."""
    if not await conn.fetchval(_QUERIES["bookkeeping_exists"]):
        return load_migrations()
    done = {r["version"] for r in await conn.fetch(_QUERIES["applied_migrations"])}
    return [m for m in load_migrations() if m.version not in done]
