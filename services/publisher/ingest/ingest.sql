-- The ingest consumer's statements (services/publisher/ingest/store_pg.py), run in a tenant's
-- transaction behind the wall (migration 0033). Every statement names its tenant.

-- name: claim_command
-- $1 tenant, $2 command id, $3 command type, $4 now (NULL: the database's), $5 when the
-- record reached Kafka (NULL: unknown). Nothing returned:
-- the command was applied before. A concurrent copy waits here on the key until the first
-- transaction ends, then inserts (it rolled back) or returns nothing (it committed).
INSERT INTO ingest_command (tenant_id, command_id, command_type, applied_at, sent_at)
VALUES ($1, $2, $3, coalesce($4::timestamptz, now()), $5)
ON CONFLICT (tenant_id, command_id) DO NOTHING
RETURNING command_id

-- name: command_answer
SELECT command_id, command_type, document_id, version_number, revision, task_id
  FROM ingest_command
 WHERE tenant_id = $1 AND command_id = $2

-- name: record_answer
UPDATE ingest_command
   SET document_id = $3, version_number = $4, revision = $5, task_id = $6
 WHERE tenant_id = $1 AND command_id = $2

-- name: document_for_key
SELECT document_id FROM ingest_document_key WHERE tenant_id = $1 AND document_key = $2

-- name: map_key
-- Nothing returned: the document already has a key (another one: the caller's key was
-- looked up first, in the same transaction).
INSERT INTO ingest_document_key (tenant_id, document_key, document_id, created_at)
VALUES ($1, $2, $3, coalesce($4::timestamptz, now()))
ON CONFLICT (tenant_id, document_id) DO NOTHING
RETURNING document_id

-- name: forget_key
-- A key whose document was deleted, before a publish maps it to a new document.
DELETE FROM ingest_document_key WHERE tenant_id = $1 AND document_key = $2

-- name: forget_document_key
-- An erased document's key (it may be personal data), in the erase command's record.
DELETE FROM ingest_document_key WHERE tenant_id = $1 AND document_id = $2

-- name: add_ingest_key
INSERT INTO tenant_ingest_key (tenant_id, key_id, public_key)
VALUES ($1, $2, $3)
ON CONFLICT (tenant_id, key_id) DO NOTHING
RETURNING created_at

-- name: list_ingest_keys
SELECT key_id, public_key, created_at, revoked_at
  FROM tenant_ingest_key
 WHERE tenant_id = $1
 ORDER BY created_at, key_id

-- name: revoke_ingest_key
UPDATE tenant_ingest_key
   SET revoked_at = coalesce($3::timestamptz, now())
 WHERE tenant_id = $1 AND key_id = $2 AND revoked_at IS NULL
RETURNING revoked_at

-- name: command_answers
-- The answers of those of $2 (command ids) applied before: a run's redeliveries in one trip.
SELECT command_id, command_type, document_id, version_number, revision, task_id
  FROM ingest_command
 WHERE tenant_id = $1 AND command_id = ANY($2::uuid[])

-- name: find_ingest_keys
-- $1 tenant, $2 key ids, $3 now (NULL: the database's): the live ones among them.
SELECT key_id, public_key
  FROM tenant_ingest_key
 WHERE tenant_id = $1
   AND key_id = ANY($2::text[])
   AND (revoked_at IS NULL OR revoked_at > coalesce($3::timestamptz, now()))

-- name: savepoint
SAVEPOINT ingest_command

-- name: release_savepoint
RELEASE SAVEPOINT ingest_command

-- name: rollback_to_savepoint
ROLLBACK TO SAVEPOINT ingest_command

-- name: refusals_sent
-- $1 tenant, $2 sources ('topic/partition/offset'): those whose dead letter was sent and
-- recorded (migration 0036), with its problem code, so a redelivered run does not send it
-- again and answers it as it was answered.
SELECT source, code FROM ingest_refusal WHERE tenant_id = $1 AND source = ANY($2::text[])

-- name: record_refusal
-- $1 tenant, $2 source, $3 command id, $4 problem code, $5 now (NULL: the database's).
INSERT INTO ingest_refusal (tenant_id, source, command_id, code, refused_at)
VALUES ($1, $2, $3, $4, coalesce($5::timestamptz, now()))
ON CONFLICT (tenant_id, source) DO NOTHING

-- name: remove_refusals
-- $1 days kept, $2 most rows, $3 now (NULL: the database's clock). The oldest refusal
-- records past the horizon, every tenant's (the process's own role, as report_backlog), by
-- the refused_at index. SKIP LOCKED: two processes' passes never wait for each other, and
-- never for a run's transaction. By ctid: the rows the sub-select locked cannot move before
-- this statement deletes them, and a TID scan finds them where a join on the key would
-- read the whole table for every batch.
DELETE FROM ingest_refusal
 WHERE ctid = ANY(ARRAY(
       SELECT ctid
         FROM ingest_refusal
        WHERE refused_at < coalesce($3::timestamptz, now()) - make_interval(days => $1::integer)
        ORDER BY refused_at
        LIMIT $2::integer
          FOR UPDATE SKIP LOCKED))

-- name: remove_commands
-- $1 days kept, $2 most rows, $3 now (NULL: the database's clock). The oldest command
-- records past the horizon, every tenant's, by the applied_at index (migration 0037), as
-- remove_refusals. A record whose index task is still to run stays: the task's switch or
-- dead event names the command from it (services/indexer). SKIP LOCKED: two passes never
-- wait for each other, nor for a run's transaction writing a record's answer.
DELETE FROM ingest_command
 WHERE ctid = ANY(ARRAY(
       SELECT c.ctid
         FROM ingest_command c
        WHERE c.applied_at < coalesce($3::timestamptz, now()) - make_interval(days => $1::integer)
          AND NOT EXISTS (
              SELECT 1
                FROM index_task t
               WHERE t.task_id = c.task_id
                 AND t.status IN ('PENDING', 'RUNNING', 'RETRY_WAIT'))
        ORDER BY c.applied_at
        LIMIT $2::integer
          FOR UPDATE OF c SKIP LOCKED))

-- name: report_backlog
-- $1 tier, $2 consumer id, $3 tenants, $4 records, $5 oldest sent_at (NULL: unknown), $6
-- now (NULL: the database's). The process's rows become what it holds now; rows of any
-- process not reported for an hour (one that died) go.
WITH gone AS (
    DELETE FROM ingest_backlog
     WHERE (tier = $1 AND consumer_id = $2 AND tenant_id <> ALL($3::text[]))
        OR reported_at < coalesce($6::timestamptz, now()) - interval '1 hour'
)
INSERT INTO ingest_backlog (tier, consumer_id, tenant_id, records, oldest_sent_at, reported_at)
SELECT $1, $2, t.tenant_id, t.records, t.oldest_sent_at, coalesce($6::timestamptz, now())
  FROM unnest($3::text[], $4::int[], $5::timestamptz[]) AS t (tenant_id, records, oldest_sent_at)
ON CONFLICT (tenant_id, tier, consumer_id) DO UPDATE
   SET records = excluded.records,
       oldest_sent_at = excluded.oldest_sent_at,
       reported_at = excluded.reported_at

-- name: documents_for_keys
-- $1 tenant, $2 keys: those mapped to a document.
SELECT document_key, document_id
  FROM ingest_document_key
 WHERE tenant_id = $1 AND document_key = ANY($2::text[])

-- name: claim_commands
-- $1 tenant, $2 command ids, $3 their types, $4 when their records reached Kafka, $5 now
-- (NULL: the database's): claim_command for many; the ids claimed now returned.
INSERT INTO ingest_command (tenant_id, command_id, command_type, applied_at, sent_at)
SELECT $1, c.command_id, c.command_type, coalesce($5::timestamptz, now()), c.sent_at
  FROM unnest($2::uuid[], $3::text[], $4::timestamptz[]) AS c (command_id, command_type, sent_at)
ON CONFLICT (tenant_id, command_id) DO NOTHING
RETURNING command_id

-- name: map_keys
-- $1 tenant, $2 keys, $3 their new documents, $4 now (NULL: the database's).
INSERT INTO ingest_document_key (tenant_id, document_key, document_id, created_at)
SELECT $1, k.document_key, k.document_id, coalesce($4::timestamptz, now())
  FROM unnest($2::text[], $3::uuid[]) AS k (document_key, document_id)

-- name: record_answers
-- $1 tenant, then per command: id, document, version, revision, task (record_answer's).
UPDATE ingest_command c
   SET document_id = a.document_id, version_number = a.version_number,
       revision = a.revision, task_id = a.task_id
  FROM unnest($2::uuid[], $3::uuid[], $4::int[], $5::bigint[], $6::uuid[])
       AS a (command_id, document_id, version_number, revision, task_id)
 WHERE c.tenant_id = $1 AND c.command_id = a.command_id
