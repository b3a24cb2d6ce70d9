"""A dev-stack replica is taken again when the primary can no longer feed it: its slot
gone (or its WAL removed, "lost"); kept when the slot can feed it or the primary cannot be
asked. Checked against the test stack's PostgreSQL."""

from __future__ import annotations

import uuid
from typing import Any
from urllib.parse import urlsplit

import asyncpg
import pytest

from kbtools.devstack.replicas import slot_can_feed

pytestmark = pytest.mark.integration


async def test_a_replica_is_fed_only_through_a_slot_the_primary_still_has(
    conn: asyncpg.Connection[Any], database_url: str
) -> None:
    port = urlsplit(database_url).port
    assert port is not None
    slot = f"kb_test_{uuid.uuid4().hex[:12]}"
    assert await slot_can_feed(port, slot) is False  # no such slot: copy again
    await conn.execute("SELECT pg_create_physical_replication_slot($1, true)", slot)
    try:
        assert await slot_can_feed(port, slot) is True
    finally:
        await conn.execute("SELECT pg_drop_replication_slot($1)", slot)
    assert await slot_can_feed(1, slot) is True  # nobody to ask: start as before
