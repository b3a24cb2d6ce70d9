-- The pipeline's source: the immutable bytes of one published document version.

-- name: load_document_version
-- Tenant-scoped: the tenant is part of the key, never inferred from the document id alone.
SELECT content, media_type, sha256, size_bytes, status
  FROM document_version
 WHERE tenant_id = $1 AND document_id = $2 AND version_number = $3
