-- Bulk publishing of new documents (services/publisher/bulk/store_pg.py): one statement per
-- table for the whole batch, in one transaction. The documents are new (ids made by the
-- publisher): no other transaction can read, lock or write them before this one commits.

-- name: tenant_tier
SELECT tier FROM tenant WHERE tenant_id = $1

-- name: insert_published_documents
-- $1 tenant, $2 tier, $3 document ids, $4 titles, $5 contents, $6 media types, $7 sha256s,
-- $8 task ids, $9 max attempts, $10 now, $11 each document's traceparent (its own trace,
-- migration 0034).
-- What create_document then publish leave behind, for every document at once: the document
-- at revision 2 with version 1 published, the version PUBLISHED, its PENDING index task.
-- The data-modifying CTEs run on one snapshot; the foreign keys from the version and task
-- rows to the document rows are checked at the end of the statement, when all exist.
WITH input AS (
    SELECT document_id, title, content, media_type, sha256, task_id, traceparent
      FROM unnest($3::uuid[], $4::text[], $5::bytea[], $6::text[], $7::bytea[], $8::uuid[],
                  $11::text[])
           AS i (document_id, title, content, media_type, sha256, task_id, traceparent)
), documents AS (
    INSERT INTO document (tenant_id, document_id, title, revision, latest_version,
                          published_version, published_at, created_at, updated_at)
    SELECT $1, document_id, title, 2, 1, 1, coalesce($10::timestamptz, now()),
           coalesce($10::timestamptz, now()), coalesce($10::timestamptz, now())
      FROM input
), versions AS (
    INSERT INTO document_version (tenant_id, document_id, version_number, content, media_type,
                                  sha256, size_bytes, status, created_at, published_at)
    SELECT $1, document_id, 1, content, media_type, sha256, octet_length(content), 'PUBLISHED',
           coalesce($10::timestamptz, now()), coalesce($10::timestamptz, now())
      FROM input
)
INSERT INTO index_task (task_id, tenant_id, document_id, version_number, task_type, tier,
                        status, max_attempts, next_attempt_at, created_at, updated_at,
                        traceparent)
SELECT task_id, $1, document_id, 1, 'INDEX_VERSION', $2, 'PENDING', $9::integer,
       coalesce($10::timestamptz, now()), coalesce($10::timestamptz, now()),
       coalesce($10::timestamptz, now()), traceparent
  FROM input

-- name: insert_acls
-- $1 tenant, $2 document ids, $3 principals: one row per (document, principal), the ACL of
-- version 1 (migration 0024). Not the served ACL (document_acl): a new document has no
-- search pointer, and its first switch applies this one (services/runtime/tenancy/served_acl.sql).
INSERT INTO document_version_acl (tenant_id, document_id, version_number, principal,
                                  permission)
SELECT $1, document_id, 1, principal, 'READ'
  FROM unnest($2::uuid[], $3::text[]) AS a (document_id, principal)
