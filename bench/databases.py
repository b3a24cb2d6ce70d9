"""The benches' scratch databases, on the server of DATABASE_URL (or the dev stack's)."""

from __future__ import annotations

import asyncpg

from services.runtime.pg.migrations import apply_migrations


def url_for(admin_url: str, name: str) -> str:
    """The URL of database ``name`` on the server of ``admin_url``."""
    base, _, _ = admin_url.rpartition("/")
    return f"{base}/{name}"


async def drop_database(admin_url: str, name: str) -> None:
    admin = await asyncpg.connect(admin_url)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


async def recreate_database(
    admin_url: str, name: str, *, migrate: bool = False, template: str | None = None
) -> str:
    """Database ``name`` created anew (empty, a copy of ``template``, or with our
    migrations); its URL."""
    await drop_database(admin_url, name)
    admin = await asyncpg.connect(admin_url)
    try:
        copied = f' TEMPLATE "{template}"' if template else ""
        await admin.execute(f'CREATE DATABASE "{name}"{copied}')
    finally:
        await admin.close()
    url = url_for(admin_url, name)
    if migrate:
        conn = await asyncpg.connect(url)
        try:
            await apply_migrations(conn)
        finally:
            await conn.close()
    return url
