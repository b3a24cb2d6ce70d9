-- Publisher queries. Every one names the tenant in its WHERE clause (or inserts it):
-- a request can only ever touch the rows of the tenant its API key belongs to.

-- name: api_key_is_valid
SELECT EXISTS (
    SELECT 1
      FROM tenant_api_key
     WHERE tenant_id = $1
       AND key_hash = $2
       AND revoked_at IS NULL
)

-- name: lock_document
-- FOR UPDATE OF d: every change to a document (new version, publish) takes this row lock
-- first, so changes of one document are serialised and the revision check below it cannot
-- race. The tenant row is only read (its tier), never locked.
SELECT d.tenant_id, d.document_id, t.tier, d.title, d.revision, d.latest_version,
       d.published_version
  FROM document d
  JOIN tenant t ON t.tenant_id = d.tenant_id
 WHERE d.tenant_id = $1
   AND d.document_id = $2
   FOR UPDATE OF d

-- name: get_version
SELECT version_number, status, media_type, sha256, size_bytes
  FROM document_version
 WHERE tenant_id = $1
   AND document_id = $2
   AND version_number = $3

-- name: read_acl
SELECT principal
  FROM document_acl
 WHERE tenant_id = $1
   AND document_id = $2
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
DELETE FROM document_acl
 WHERE tenant_id = $1
   AND document_id = $2
   AND permission = 'READ'

-- name: insert_acl
INSERT INTO document_acl (tenant_id, document_id, principal, permission)
SELECT $1, $2, principal, 'READ'
  FROM unnest($3::text[]) AS principal

-- name: document_status
-- The published version's task, its columns prefixed with task_ (the document has columns
-- of the same names): the one the publish enqueued for the serving generation, not those
-- of generations built beside it (generation_id set).
SELECT d.document_id, d.title, d.revision, d.latest_version, d.published_version,
       d.published_at, s.version_number AS search_version, s.switched_at AS search_switched_at,
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
  LEFT JOIN index_task t
         ON t.tenant_id = d.tenant_id
        AND t.document_id = d.document_id
        AND t.version_number = d.published_version
        AND t.task_type = $3
        AND t.generation_id IS NULL
 WHERE d.tenant_id = $1
   AND d.document_id = $2

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
INSERT INTO tenant_api_key (key_id, tenant_id, key_hash)
VALUES ($1, $2, $3)
