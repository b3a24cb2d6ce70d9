-- The pipeline's source: the immutable bytes of one published document version.

-- name: load_document_versions
-- Tenant-scoped: the tenant is part of the key, never inferred from the document id alone.
-- $1 tenants, $2 documents, $3 versions, one element per version: the immutable bytes of the
-- versions of several tasks at once (services/runtime/pg/coalesce.py), each row with its
-- key. A version not found has no row. content_removed_at: retention emptied the content
-- (migration 0032); the indexer refuses the version rather than read the empty bytes.
SELECT v.tenant_id, v.document_id, v.version_number,
       v.content, v.media_type, v.sha256, v.size_bytes, v.status,
       v.content_removed_at IS NOT NULL AS content_removed
  FROM unnest($1::text[], $2::uuid[], $3::integer[])
       AS k (tenant_id, document_id, version_number)
  JOIN document_version v
    ON v.tenant_id = k.tenant_id
   AND v.document_id = k.document_id
   AND v.version_number = k.version_number
