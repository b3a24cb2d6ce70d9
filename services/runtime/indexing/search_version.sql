-- What a document's search pointer (document_search_version) serves, said once for the
-- services that read it: `kb index check` (services/indexer/maintenance/index_check.sql)
-- and the operator page (services/operator/queries.sql) include it.

-- name: current_version_chunks
-- The chunks of every document's current search version: those of the version its pointer
-- names, under the pointer's embedding model AND chunking strategy (another generation's
-- chunks of the same version are not served). A pointer that names no strategy (written by
-- hand, before the sink existed) serves no chunk. Where it is included, a tenant and a
-- document are given: one probe of the pointer's primary key, and one range of the chunks'.
SELECT c.tenant_id, c.document_id, c.chunk_id, c.ordinal, c.heading_path, c.text
  FROM document_search_version s
  JOIN knowledge_chunk c
    ON c.tenant_id = s.tenant_id
   AND c.document_id = s.document_id
   AND c.version_number = s.version_number
   AND c.embedding_model = s.embedding_model
   AND c.chunking_strategy = s.chunking_strategy
