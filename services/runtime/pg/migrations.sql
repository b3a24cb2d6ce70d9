-- The migration runner's bookkeeping (services/runtime/pg/migrations.py). The migrations
-- themselves are the numbered files of migrations/.

-- name: lock_migrations
-- $1 the runner's advisory lock key (MIGRATION_LOCK_KEY), held for the session: see
-- apply_migrations.
SELECT pg_advisory_lock($1)

-- name: unlock_migrations
SELECT pg_advisory_unlock($1)

-- name: create_bookkeeping
CREATE TABLE IF NOT EXISTS schema_migration (
    version     integer PRIMARY KEY,
    name        text        NOT NULL,
    checksum    text        NOT NULL,
    applied_at  timestamptz NOT NULL DEFAULT now()
)

-- name: bookkeeping_exists
SELECT to_regclass('schema_migration') IS NOT NULL

-- name: applied_migrations
SELECT version, name, checksum FROM schema_migration

-- name: record_migration
-- In the migration's own transaction: the file and its row commit together.
INSERT INTO schema_migration (version, name, checksum) VALUES ($1, $2, $3)
