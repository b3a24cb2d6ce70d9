"""The migrated schema is what the code expects. Every test but the last needs PostgreSQL (and
is marked `integration`); the last only reads the files."""

from __future__ import annotations

from typing import Any

import asyncpg
import pytest

from services.runtime.errors import MigrationChecksumMismatch, MigrationError
from services.runtime.pg.migrations import Migration, apply_migrations, load_migrations
from services.runtime.pg.sql import all_query_files, load_queries
from tests.support.stack import REPO_ROOT, Stack, create_test_database, drop_test_database


@pytest.fixture
async def empty_database(stack: Stack) -> Any:
    name = await create_test_database(stack, "template0")
    conn = await asyncpg.connect(stack.database_url(name))
    try:
        yield conn
    finally:
        await conn.close()
        await drop_test_database(stack, name)


async def _columns(conn: asyncpg.Connection[Any]) -> dict[str, dict[str, str]]:
    rows = await conn.fetch(
        """
        SELECT table_name, column_name, udt_name
          FROM information_schema.columns
         WHERE table_schema = 'public'
        """
    )
    tables: dict[str, dict[str, str]] = {}
    for row in rows:
        tables.setdefault(row["table_name"], {})[row["column_name"]] = row["udt_name"]
    return tables


@pytest.mark.integration
async def test_applying_twice_is_a_no_op(empty_database: asyncpg.Connection[Any]) -> None:
    first = await apply_migrations(empty_database)
    schema_after_first = await _columns(empty_database)
    second = await apply_migrations(empty_database)

    assert [m.version for m in first.applied] == [m.version for m in load_migrations()]
    assert second.applied == []
    assert len(second.already_applied) == len(first.applied)
    assert await _columns(empty_database) == schema_after_first


@pytest.mark.integration
async def test_schema_has_every_table_and_key_of_the_design(
    empty_database: asyncpg.Connection[Any],
) -> None:
    await apply_migrations(empty_database)
    tables = await _columns(empty_database)

    expected_columns = {
        "tenant": {"tenant_id", "tier"},
        "tenant_api_key": {"tenant_id", "key_hash"},
        "document": {"tenant_id", "document_id", "revision", "latest_version", "published_version"},
        "document_version": {
            "tenant_id",
            "document_id",
            "version_number",
            "content",
            "media_type",
            "sha256",
            "size_bytes",
            "status",
            # Migration 0032: retention of superseded versions' content.
            "superseded_at",
            "content_removed_at",
        },
        "document_acl": {"tenant_id", "document_id", "principal", "permission"},
        # Migration 0036: signed commands refused in a batched run, by where they were read.
        "ingest_refusal": {"tenant_id", "source", "command_id", "code", "refused_at"},
        "document_version_acl": {
            "tenant_id",
            "document_id",
            "version_number",
            "principal",
            "permission",
        },
        "index_task": {
            "task_id",
            "tenant_id",
            "document_id",
            "version_number",
            "task_type",
            "status",
            "attempts",
            "lease_owner",
            "lease_until",
            "next_attempt_at",
            "error_code",
            "error_message",
            "created_at",
            "updated_at",
            "tier",
            "generation_id",
            "priority",
            "traceparent",
        },
        "outbox": {
            "position",
            "txid",
            "event_id",
            "event_type",
            "tenant_id",
            "tier",
            "aggregate_key",
            "payload",
            "created_at",
            "traceparent",
        },
        "knowledge_chunk": {
            "tenant_id",
            "document_id",
            "version_number",
            "embedding_model",
            "chunk_id",
            "ordinal",
            "heading_path",
            "text",
            "content_digest",
            "embedding",
        },
        "document_search_version": {
            "tenant_id",
            "document_id",
            "version_number",
            "embedding_model",
        },
        "knowledge_chunk_stream": {
            "task_id",
            "lease_attempt",
            "chunk_id",
            "ordinal",
            "heading_path",
            "text",
            "content_digest",
            "embedding",
        },
    }
    for table, columns in expected_columns.items():
        assert table in tables, f"missing table {table}"
        assert columns <= set(tables[table]), f"{table} lacks {columns - set(tables[table])}"
    assert tables["knowledge_chunk"]["embedding"] == "vector"
    assert tables["outbox"]["txid"] == "xid8"

    unique_keys = await empty_database.fetch(
        """
        SELECT conrelid::regclass::text AS table_name,
               array_agg(a.attname ORDER BY k.ordinality) AS columns
          FROM pg_constraint c
          CROSS JOIN LATERAL unnest(c.conkey) WITH ORDINALITY AS k(attnum, ordinality)
          JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = k.attnum
         WHERE c.contype IN ('p', 'u')
         GROUP BY c.oid, conrelid
        """
    )
    keys = {(r["table_name"], tuple(r["columns"])) for r in unique_keys}
    assert (
        "index_task",
        ("tenant_id", "document_id", "version_number", "task_type", "generation_id"),
    ) in keys
    assert (
        "knowledge_chunk",
        ("tenant_id", "document_id", "version_number", "embedding_model", "chunk_id"),
    ) in keys
    assert ("document_search_version", ("tenant_id", "document_id")) in keys
    assert ("knowledge_chunk_stream", ("task_id", "lease_attempt", "ordinal")) in keys
    # Staged slices are scratch: never WAL-logged (migration 0013).
    persistence = await empty_database.fetchval(
        "SELECT relpersistence::text FROM pg_class WHERE oid = 'knowledge_chunk_stream'::regclass"
    )
    assert persistence == "u"

    # The claim must be able to use partial indexes that leave finished tasks out.
    index_defs = await empty_database.fetch(
        "SELECT indexdef FROM pg_indexes WHERE tablename = 'index_task'"
    )
    partial = [r["indexdef"] for r in index_defs if " WHERE " in r["indexdef"]]
    claimable = [d for d in partial if "PENDING" in d or "RUNNING" in d]
    assert claimable, "index_task needs partial indexes on claimable states"

    # Migration 0037: the command records' retention takes the oldest first, every tenant's,
    # by an index leading with applied_at (the others lead with the tenant).
    command_indexes = await empty_database.fetch(
        "SELECT indexdef FROM pg_indexes WHERE tablename = 'ingest_command'"
    )
    assert any(r["indexdef"].endswith("USING btree (applied_at)") for r in command_indexes), (
        "ingest_command needs an index on applied_at for its retention"
    )
    assert all("SUCCEEDED" not in d and "DEAD" not in d for d in claimable)


@pytest.mark.integration
async def test_every_named_query_prepares_against_the_migrated_schema(
    conn: asyncpg.Connection[Any],
) -> None:
    # The chaos run's checks keep theirs the same way (kbtools/chaos/).
    files = all_query_files(REPO_ROOT / "services") + all_query_files(REPO_ROOT / "kbtools")
    for path in files:
        for name, sql in load_queries(path).items():
            try:
                await conn.prepare(sql)
            except asyncpg.PostgresError as exc:  # pragma: no cover - the failure message
                pytest.fail(f"{path.relative_to(REPO_ROOT)}:{name} does not prepare: {exc}")
    # Search's statements as they run: each model's text per path and, for the keyword list,
    # per kinds of candidates (a left-out kind's empty body must keep the row type and the
    # statement its parameters' types).
    from services.search.statements import (
        KEYWORD_KINDS,
        KEYWORD_STATEMENT,
        VECTOR_STATEMENT,
        VectorPath,
        specialised_search_sql,
    )

    for path_ in VectorPath:
        variants = [specialised_search_sql("m", 8, VECTOR_STATEMENT, path_)] + [
            specialised_search_sql("m", 8, KEYWORD_STATEMENT, path_, kinds)
            for kinds in KEYWORD_KINDS
        ]
        for sql in variants:
            await conn.prepare(sql)


@pytest.mark.integration
async def test_an_edited_applied_migration_is_refused(
    empty_database: asyncpg.Connection[Any],
) -> None:
    migrations = load_migrations()
    await apply_migrations(empty_database, migrations)
    edited = [
        Migration(migrations[0].version, migrations[0].name, migrations[0].sql + "\n-- edited\n"),
        *migrations[1:],
    ]
    with pytest.raises(MigrationChecksumMismatch):
        await apply_migrations(empty_database, edited)


@pytest.mark.integration
async def test_a_database_ahead_of_the_code_is_refused(
    empty_database: asyncpg.Connection[Any],
) -> None:
    migrations = load_migrations()
    await apply_migrations(empty_database, migrations)
    await empty_database.execute(
        "INSERT INTO schema_migration (version, name, checksum) VALUES (9999, 'future', 'x')"
    )
    with pytest.raises(MigrationError, match="does not know"):
        await apply_migrations(empty_database, migrations)


@pytest.mark.integration
async def test_concurrent_migrate_runs_apply_each_file_once(
    stack: Stack,
) -> None:
    name = await create_test_database(stack, "template0")
    conns = [await asyncpg.connect(stack.database_url(name)) for _ in range(3)]
    try:
        import asyncio

        reports = await asyncio.gather(*(apply_migrations(c) for c in conns))
        applied = sorted(m.version for r in reports for m in r.applied)
        assert applied == [m.version for m in load_migrations()]
    finally:
        for c in conns:
            await c.close()
        await drop_test_database(stack, name)


def test_migration_files_are_plain_numbered_sql() -> None:
    # Beside the migrations only their README: `load_migrations` reads `*.sql` alone, so a
    # migration misnamed `.SQL` or `.sql.bak` would be skipped silently.
    files = sorted(p for p in (REPO_ROOT / "migrations").glob("*") if p.name != "README.md")
    assert files, "no migrations"
    for path in files:
        assert path.suffix == ".sql", path
    assert [m.version for m in load_migrations()] == sorted(m.version for m in load_migrations())


@pytest.mark.integration
async def test_0024_gives_each_version_that_can_still_be_served_the_documents_acl(
    empty_database: asyncpg.Connection[Any],
) -> None:
    """Before 0024 the document's ACL applied to whichever version search served: the
    backfill makes it the ACL of the published version, the served one and those between,
    not of versions below the pointer (never served again) nor of drafts."""
    conn = empty_database
    await apply_migrations(conn, [m for m in load_migrations() if m.version < 24])
    await conn.execute("INSERT INTO tenant (tenant_id, tier) VALUES ('acme', 'standard')")
    served, unserved = (
        "00000000-0000-0000-0000-000000000001",
        "00000000-0000-0000-0000-000000000002",
    )
    for document_id, published in ((served, 4), (unserved, 1)):
        await conn.execute(
            "INSERT INTO document (tenant_id, document_id, title, latest_version,"
            " published_version) VALUES ('acme', $1::uuid, 'policy', 5, $2)",
            document_id,
            published,
        )
        for version in range(1, 6):
            await conn.execute(
                "INSERT INTO document_version (tenant_id, document_id, version_number, content,"
                " media_type, sha256, size_bytes, status)"
                " VALUES ('acme', $1::uuid, $2, 'x', 'text/plain', $3, 1, $4)",
                document_id,
                version,
                bytes(32),
                "PUBLISHED" if version <= published else "DRAFT",
            )
        await conn.execute(
            "INSERT INTO document_acl (tenant_id, document_id, principal, permission)"
            " SELECT 'acme', $1::uuid, p, 'READ' FROM unnest($2::text[]) AS p",
            document_id,
            ["group:hr", "u:ann"],
        )
    # The served document: its pointer at version 2, version 4 published (3 in between).
    await conn.execute(
        "INSERT INTO document_search_version (tenant_id, document_id, version_number,"
        " embedding_model) VALUES ('acme', $1::uuid, 2, 'm')",
        served,
    )

    await apply_migrations(conn)

    rows = await conn.fetch(
        "SELECT document_id::text, version_number, principal, permission"
        "  FROM document_version_acl ORDER BY 1, 2, 3"
    )
    assert [tuple(r) for r in rows] == [
        (served, v, p, "READ") for v in (2, 3, 4) for p in ("group:hr", "u:ann")
    ] + [(unserved, 1, p, "READ") for p in ("group:hr", "u:ann")]
    # The served ACL is left as it was.
    assert await conn.fetchval("SELECT count(*) FROM document_acl") == 4
