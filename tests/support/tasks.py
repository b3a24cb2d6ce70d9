"""Index tasks for tests, inserted the way the publisher will create them:
tenant -> document -> document_version (PUBLISHED) -> index_task.

Until the publisher's API exists this is the one place tests make tasks; it writes rows
directly and returns their ids.
"""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeAlias

import asyncpg

Executor: TypeAlias = "asyncpg.Connection[Any] | asyncpg.Pool[Any]"


@dataclass(frozen=True)
class CreatedTask:
    task_id: uuid.UUID
    tenant_id: str
    document_id: uuid.UUID
    version_number: int
    tier: str


async def ensure_tenant(db: Executor, tenant_id: str, tier: str) -> None:
    await db.execute(
        "INSERT INTO tenant (tenant_id, tier) VALUES ($1, $2) ON CONFLICT DO NOTHING",
        tenant_id,
        tier,
    )


async def create_task(
    db: Executor,
    *,
    tenant_id: str = "acme",
    tier: str = "standard",
    content: bytes = b"refund policy v1: 30 days, no questions asked\n",
    media_type: str = "text/plain",
    max_attempts: int = 8,
    next_attempt_at: datetime | None = None,
    stored_sha256: bytes | None = None,
    stored_size: int | None = None,
) -> CreatedTask:
    """One published version and its PENDING index task. ``stored_sha256`` /
    ``stored_size`` let a test store a digest or size that does not match the content."""
    await ensure_tenant(db, tenant_id, tier)
    document_id = uuid.uuid4()
    task_id = uuid.uuid4()
    sha256 = stored_sha256 if stored_sha256 is not None else hashlib.sha256(content).digest()
    size = stored_size if stored_size is not None else len(content)
    await db.execute(
        """
        WITH doc AS (
            INSERT INTO document (tenant_id, document_id, title, latest_version,
                                  published_version, published_at)
            VALUES ($1, $2, 'test document', 1, 1, now())
            RETURNING tenant_id, document_id
        ), version AS (
            INSERT INTO document_version (tenant_id, document_id, version_number, content,
                                          media_type, sha256, size_bytes, status, published_at)
            SELECT tenant_id, document_id, 1, $3, $4, $5, $6, 'PUBLISHED', now() FROM doc
            RETURNING tenant_id, document_id, version_number
        )
        INSERT INTO index_task (task_id, tenant_id, document_id, version_number, tier,
                                max_attempts, next_attempt_at)
        SELECT $7, tenant_id, document_id, version_number, $8, $9, coalesce($10, now())
          FROM version
        """,
        tenant_id,
        document_id,
        content,
        media_type,
        sha256,
        size,
        task_id,
        tier,
        max_attempts,
        next_attempt_at,
    )
    return CreatedTask(task_id, tenant_id, document_id, 1, tier)


async def create_many_tasks(
    db: Executor,
    count: int,
    *,
    tenant_id: str = "bulk",
    tier: str = "standard",
    next_attempt_at: datetime | None = None,
) -> None:
    """``count`` due tasks of one tenant in one statement (fairness tests, benchmarks)."""
    await ensure_tenant(db, tenant_id, tier)
    content = b"x"
    await db.execute(
        """
        WITH ids AS (
            SELECT gen_random_uuid() AS document_id, gen_random_uuid() AS task_id,
                   g AS n
              FROM generate_series(1, $2::integer) AS g
        ), doc AS (
            INSERT INTO document (tenant_id, document_id, title, latest_version,
                                  published_version, published_at)
            SELECT $1, document_id, 'bulk document', 1, 1, now() FROM ids
        ), version AS (
            INSERT INTO document_version (tenant_id, document_id, version_number, content,
                                          media_type, sha256, size_bytes, status, published_at)
            SELECT $1, document_id, 1, $3, 'text/plain', $4, $5, 'PUBLISHED', now() FROM ids
        )
        INSERT INTO index_task (task_id, tenant_id, document_id, version_number, tier,
                                next_attempt_at)
        SELECT task_id, $1, document_id, 1, $6,
               coalesce($7::timestamptz, now()) - make_interval(secs => $2::integer - n)
          FROM ids
        """,
        tenant_id,
        count,
        content,
        hashlib.sha256(content).digest(),
        len(content),
        tier,
        next_attempt_at,
    )


async def supersede_40_days_ago(db: Executor, created: CreatedTask) -> None:
    """``created``'s version 1, its task finished, superseded by a version 2 published 40
    days ago by the database's clock: due for retention at 30 days, kept at 50."""
    await db.execute(
        """WITH t AS (UPDATE index_task SET status = 'SUCCEEDED', finished_at = now()
                       WHERE task_id = $3),
                v AS (INSERT INTO document_version (tenant_id, document_id, version_number,
                                                   content, media_type, sha256, size_bytes,
                                                   status, published_at)
                      VALUES ($1, $2, 2, 'v2', 'text/plain', sha256('v2'), 2, 'PUBLISHED',
                              now() - interval '40 days'))
           UPDATE document SET latest_version = 2, published_version = 2
            WHERE tenant_id = $1 AND document_id = $2""",
        created.tenant_id,
        created.document_id,
        created.task_id,
    )
