-- Publisher queries. Every one names the tenant in its WHERE clause (or inserts it):
-- a request can only ever touch the rows of the tenant its API key belongs to.

-- name: lock_document
-- FOR NO KEY UPDATE OF d: every change to a document (new version, publish) takes this row
-- lock first, so changes of one document are serialised (the mode conflicts with itself) and
-- the revision check below it cannot race. Not FOR UPDATE: a completion writes rows whose
-- foreign keys name the document (the search pointer, document_generation_version, the
-- served ACL in document_acl), and each such check takes FOR KEY SHARE on this row, which
-- FOR UPDATE blocks and FOR NO KEY UPDATE does not. With FOR UPDATE a publish holding this
-- row and waiting for the completion (its task's key, the pointer row) deadlocked with the
-- completion waiting for this row (issue 29). The publish never changes the document's key,
-- and its UPDATEs of the row take no stronger lock than this one. The tenant row is only read
-- (its tier), never locked.
-- deleted_at: set once the document is deleted (delete_document below); every change but a
-- repeated delete is refused then (DOCUMENT_DELETED).
SELECT d.tenant_id, d.document_id, t.tier, d.title, d.revision, d.latest_version,
       d.published_version, d.deleted_at
  FROM document d
  JOIN tenant t ON t.tenant_id = d.tenant_id
 WHERE d.tenant_id = $1
   AND d.document_id = $2
   FOR NO KEY UPDATE OF d

-- name: get_version
SELECT version_number, status, media_type, sha256, size_bytes
  FROM document_version
 WHERE tenant_id = $1
   AND document_id = $2
   AND version_number = $3

-- name: read_acl
-- $1 tenant, $2 document, $3 version: the READ ACL the version was published with
-- (document_version_acl, migration 0024).
SELECT principal
  FROM document_version_acl
 WHERE tenant_id = $1
   AND document_id = $2
   AND version_number = $3
   AND permission = 'READ'

-- name: insert_document
-- A new document starts with its first version: revision 1, latest version 1.
INSERT INTO document (tenant_id, document_id, title, revision, latest_version, created_at,
                      updated_at)
VALUES ($1, $2, $3, 1, 1, coalesce($4::timestamptz, now()), coalesce($4::timestamptz, now()))

-- name: insert_version
INSERT INTO document_version (tenant_id, document_id, version_number, content, media_type,
                              sha256, size_bytes, status, created_at)
VALUES ($1, $2, $3, $4::bytea, $5, $6, octet_length($4::bytea), 'DRAFT', coalesce($7::timestamptz, now()))

-- name: record_new_version
UPDATE document
   SET latest_version = $3,
       revision = revision + 1,
       updated_at = coalesce($4::timestamptz, now())
 WHERE tenant_id = $1
   AND document_id = $2
RETURNING revision

-- name: mark_version_published
-- published_at keeps the first publication time when an ACL-only change re-publishes.
UPDATE document_version
   SET status = 'PUBLISHED',
       published_at = coalesce(published_at, $4::timestamptz, now())
 WHERE tenant_id = $1
   AND document_id = $2
   AND version_number = $3

-- name: set_published_version
-- published_at is when the current published version became published: the start of the
-- time the search version may lag behind it. An ACL-only change keeps it.
UPDATE document
   SET published_at = CASE WHEN published_version IS DISTINCT FROM $3
                           THEN coalesce($4::timestamptz, now())
                           ELSE published_at END,
       published_version = $3,
       revision = revision + 1,
       updated_at = coalesce($4::timestamptz, now())
 WHERE tenant_id = $1
   AND document_id = $2
RETURNING revision

-- name: delete_acl
-- $1 tenant, $2 document, $3 version: the version's ACL, replaced by a publish of it.
DELETE FROM document_version_acl
 WHERE tenant_id = $1
   AND document_id = $2
   AND version_number = $3
   AND permission = 'READ'

-- name: insert_acl
INSERT INTO document_version_acl (tenant_id, document_id, version_number, principal,
                                  permission)
SELECT $1, $2, $3, principal, 'READ'
  FROM unnest($4::text[]) AS principal

-- name: lock_search_pointer
-- $1 tenant, $2 document: the version search serves, its pointer row locked until commit.
-- Lock order (issue 29, "one lock order for publish and completion"): a publish locks the
-- document row (lock_document), its index task's key (the insert of ensure_index_task waits
-- for a completion updating that task), then this pointer row, then writes the served ACL
-- rows, then takes the outbox's lock of the document; a completion locks its task row, the
-- serving generation's row (FOR SHARE), the collector's mark, this pointer row, the chunks,
-- the served ACL rows, then the outbox's lock. A completion never waits for the document
-- row (its foreign key checks take FOR KEY SHARE, which lock_document's FOR NO KEY UPDATE
-- does not block), and both take task, pointer, ACL and outbox in that order, so the two
-- never wait for each other in a cycle. Hence replace_acl runs after ensure_index_task. Under READ COMMITTED, FOR
-- UPDATE waits for a completion holding the row and returns the row as it committed it: a
-- switch to the version this publish publishes is seen, and the ACL applied after it. No
-- row: nothing is served, the served ACL is left alone (the first switch sets it).
SELECT version_number
  FROM document_search_version
 WHERE tenant_id = $1
   AND document_id = $2
   FOR UPDATE

-- name: document_status
-- The published version's task, its columns prefixed with task_ (the document has columns
-- of the same names): the one the publish enqueued for the serving generation, not those
-- of generations built beside it (generation_id set).
-- search_token (docs/scaling.md#read-your-switch): a WAL position read after this
-- statement's snapshot was taken, so after the commit of the switch it sees was inserted
-- into the WAL (a transaction becomes visible only once its commit record is in): on the
-- primary its WAL insert position; on a replica the larger of the positions it has received
-- and replayed. Not the replayed one alone: a replica makes a commit visible while it
-- replays the record, before pg_last_wal_replay_lsn() moves past it, so a snapshot may see
-- a commit that position does not cover yet; a streamed record was received before it was
-- replayed. (WAL a replica restores from an archive is not counted as received: there only
-- the replayed position is known, and that window remains.) Either is at or
-- past the end of the switch's commit record: a server that has replayed it serves this
-- search_version or a later one. Conservative (later than the commit), never early.
SELECT d.document_id, d.title, d.revision, d.latest_version, d.published_version,
       d.published_at, d.deleted_at, e.erased_at, s.version_number AS search_version,
       s.switched_at AS search_switched_at,
       CASE WHEN s.version_number IS NULL THEN NULL
            WHEN pg_is_in_recovery()
                 THEN greatest(pg_last_wal_receive_lsn(), pg_last_wal_replay_lsn())
            ELSE pg_current_wal_insert_lsn()
       END::text AS search_token,
       t.task_id AS task_task_id, t.tenant_id AS task_tenant_id,
       t.document_id AS task_document_id, t.version_number AS task_version_number,
       t.task_type AS task_task_type, t.tier AS task_tier, t.status AS task_status,
       t.attempts AS task_attempts, t.max_attempts AS task_max_attempts,
       t.lease_owner AS task_lease_owner, t.lease_until AS task_lease_until,
       t.next_attempt_at AS task_next_attempt_at, t.error_code AS task_error_code,
       t.error_message AS task_error_message, t.created_at AS task_created_at,
       t.updated_at AS task_updated_at, t.finished_at AS task_finished_at
  FROM document d
  LEFT JOIN document_search_version s
         ON s.tenant_id = d.tenant_id AND s.document_id = d.document_id
  LEFT JOIN document_erasure e
         ON e.tenant_id = d.tenant_id AND e.document_id = d.document_id
  LEFT JOIN index_task t
         ON t.tenant_id = d.tenant_id
        AND t.document_id = d.document_id
        AND t.version_number = d.published_version
        AND t.task_type = $3
        AND t.generation_id IS NULL
 WHERE d.tenant_id = $1
   AND d.document_id = $2

-- name: cancel_document_tasks
-- $1 tenant, $2 document, $3 error message, $4 now. A delete ends the document's unfinished
-- index tasks (every version, every generation): DEAD with DOCUMENT_DELETED, lease cleared.
-- No worker claims them again, and a running one is fenced out as by a lost lease: its
-- heartbeat, complete and fail all require RUNNING under its lease. Lock order: after the
-- document row (lock_document), before the pointer row (tombstone_search_pointer), the order
-- a publish takes them in; the task rows in (version, task) order, the order completions
-- lock a document's task rows in. A completion holding one of them (its fence passed) is
-- waited for: it commits SUCCEEDED (then the FOR UPDATE's re-check leaves it out, and the
-- tombstone below comes after its switch) or rolls back. How many ended: the event says.
WITH locked AS (
    SELECT task_id
      FROM index_task
     WHERE tenant_id = $1
       AND document_id = $2
       AND status IN ('PENDING', 'RUNNING', 'RETRY_WAIT')
     ORDER BY version_number, task_id
       FOR UPDATE
)
UPDATE index_task t
   SET status = 'DEAD',
       error_code = 'DOCUMENT_DELETED',
       error_message = $3,
       lease_owner = NULL,
       lease_until = NULL,
       finished_at = coalesce($4::timestamptz, now()),
       updated_at = coalesce($4::timestamptz, now())
  FROM locked l
 WHERE t.tenant_id = $1
   AND t.task_id = l.task_id
RETURNING t.task_id

-- name: discard_deleted_tasks_staging
-- $1 tenant, $2 the tasks cancel_document_tasks ended: the slices a running one had staged
-- (knowledge_chunk_stream) go with it, through migration 0030's function (the table is not
-- the API role's to read). How many rows went.
SELECT discard_deleted_tasks_staging($1, $2::uuid[])

-- name: tombstone_search_pointer
-- $1 tenant, $2 document, $3 the document's latest version, $4 now. The pointer moves
-- forward to a tombstone (migration 0030): no strategy, no chunks, deleted_at set, at the
-- latest version or the one it names if that is higher (never back: migrations 0006, 0021).
-- Search joins the pointer's strategy to the chunks' (search.sql: current_search_version), so
-- from this commit on no search statement returns the document, on the primary or on any
-- replica that has replayed the commit. A document never served gets its first pointer as a
-- tombstone (embedding_model '': it names no generation; the insert raises its high-water
-- mark), so a late completion finds a pointer to refuse on either way
-- (services/indexer/sink/together.py). The row is locked until commit (the upsert), after the
-- task rows: the order of a publish and a completion. `old` (PostgreSQL 18 RETURNING): the
-- version served until now, NULL when none was.
INSERT INTO document_search_version AS s (tenant_id, document_id, version_number,
                                          embedding_model, chunking_strategy, chunk_count,
                                          task_id, switched_at, deleted_at)
VALUES ($1, $2, $3, '', NULL, 0, NULL, coalesce($4::timestamptz, now()),
        coalesce($4::timestamptz, now()))
ON CONFLICT (tenant_id, document_id) DO UPDATE
   SET version_number = greatest(s.version_number, EXCLUDED.version_number),
       chunking_strategy = NULL,
       chunk_count = 0,
       task_id = NULL,
       switched_at = EXCLUDED.switched_at,
       deleted_at = EXCLUDED.deleted_at
 WHERE s.deleted_at IS NULL
RETURNING old.version_number AS previous_version

-- name: delete_served_acl
-- $1 tenant, $2 document: the served ACL goes with the pointer's tombstone. Nothing of the
-- document is served any more, and no principal is left that search would match it for.
-- The versions' own ACLs (document_version_acl) stay: they are the record of what each
-- version was published with, and nothing serves them again (the tombstone is final).
DELETE FROM document_acl
 WHERE tenant_id = $1
   AND document_id = $2

-- name: mark_document_deleted
-- $1 tenant, $2 document, $3 now. The document's revision bumped and its deletion time
-- set, once (the WHERE, and migration 0030's trigger against any other writer).
UPDATE document
   SET deleted_at = coalesce($3::timestamptz, now()),
       revision = revision + 1,
       updated_at = coalesce($3::timestamptz, now())
 WHERE tenant_id = $1
   AND document_id = $2
   AND deleted_at IS NULL
RETURNING revision, deleted_at

-- name: primary_search_token
-- A WAL position of the primary, read after the delete committed: past the delete's commit
-- record (a commit returns once its record is in the WAL). A search passing it in `after` is answered
-- only by a server that has replayed the tombstone (docs/scaling.md#read-your-switch).
SELECT pg_current_wal_insert_lsn()::text

-- name: index_task
SELECT task_id, tenant_id, document_id, version_number, task_type, tier, status, attempts,
       max_attempts, lease_owner, lease_until, next_attempt_at, error_code, error_message,
       created_at, updated_at, finished_at
  FROM index_task
 WHERE tenant_id = $1
   AND task_id = $2

-- name: ping
-- The readiness probe's round trip: the database answers.
SELECT 1

-- name: insert_tenant
INSERT INTO tenant (tenant_id, tier)
VALUES ($1, $2)
ON CONFLICT (tenant_id) DO NOTHING
RETURNING tenant_id

-- name: insert_api_key
-- The first key of a new tenant: an admin key, as every key was before scopes.
INSERT INTO tenant_api_key (key_id, tenant_id, key_hash, name, scopes, principal_source)
VALUES ($1, $2, $3, 'initial', ARRAY['admin'], 'caller')

-- name: start_erasure
-- $1 tenant, $2 document, $3 key id (NULL: the CLI), $4 requested_by, $5 now. The erase's
-- audit row (migration 0031), in progress, written in the transaction that deleted the
-- document (or found it deleted). A re-run finds the row there and gets it back unchanged:
-- the first request's time and key stay the record.
WITH added AS (
    INSERT INTO document_erasure (tenant_id, document_id, key_id, requested_by, requested_at)
    VALUES ($1, $2, $3, $4, coalesce($5::timestamptz, now()))
    ON CONFLICT (tenant_id, document_id) DO NOTHING
    RETURNING requested_at, erased_at
)
SELECT requested_at, erased_at FROM added
UNION ALL
SELECT requested_at, erased_at
  FROM document_erasure
 WHERE tenant_id = $1
   AND document_id = $2
   AND NOT EXISTS (SELECT 1 FROM added)
