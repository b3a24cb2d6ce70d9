-- The retention of ingest command records (issue 44, KB_INGEST_COMMAND_RETENTION_DAYS):
-- every `kb ingest run` deletes those applied before the horizon, every tenant's, oldest
-- first, a batch at a time. The primary key and ingest_command_applied both lead with the
-- tenant: without this index each pass would read the whole table to find the oldest rows.
--
-- A plain build, not CONCURRENTLY (a migration is one transaction): ingest's writes to
-- this table wait until the build ends -- commands delayed a few seconds, none lost -- and
-- the table is at its largest now, before its first pass. The lock is waited for at most
-- 10s, so a long transaction holding the table fails the migration rather than queue
-- every writer behind it.
SET LOCAL lock_timeout = '10s';

CREATE INDEX ingest_command_applied_at ON ingest_command (applied_at);
