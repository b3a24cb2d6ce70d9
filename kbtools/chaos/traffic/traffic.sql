-- What the load and the searcher read of the database (kbtools/chaos/traffic/).

-- name: command_answer
-- $1 tenant, $2 command id: what its record says, the answer an HTTP publish would give.
SELECT document_id::text, version_number, revision, task_id::text
  FROM ingest_command
 WHERE tenant_id = $1 AND command_id = $2

-- name: wal_position
-- A search token: the primary's WAL position.
SELECT pg_current_wal_lsn()::text

-- name: replay_position
-- How far a replica has replayed.
SELECT pg_last_wal_replay_lsn()::text
