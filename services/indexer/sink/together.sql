-- The sink's statements for a group of completions written together
-- (services/indexer/sink/together.py): sink.sql's per-version statements over the group's
-- documents at once, one array element per completion. A group holds at most one
-- completion per document, and every statement takes its rows in (tenant, document) order,
-- the order in which every group -- and every completion written alone, one document after
-- the other -- takes them: two groups touching the same documents wait for each other,
-- never in a cycle.

-- name: lock_search_pointers
-- $1 tenants, $2 documents: one (tenant, document) pair per element. lock_search_pointer for
-- each document (sink.sql says what the lock is for). The rows are locked in (tenant,
-- document) order: FOR UPDATE locks the rows as they leave the sort (the plan's LockRows node
-- sits above it). A document without a row has no pointer yet; nothing is locked for it
-- (sink.sql: lock_search_pointer).
SELECT s.tenant_id, s.document_id, s.version_number, s.embedding_model, s.chunking_strategy,
       s.chunk_count
  FROM document_search_version s
 WHERE (s.tenant_id, s.document_id) IN (SELECT k.tenant_id, k.document_id
                                           FROM unnest($1::text[], $2::uuid[])
                                                AS k (tenant_id, document_id))
 ORDER BY s.tenant_id, s.document_id
   FOR UPDATE OF s

-- name: replace_versions_chunks
-- $1 tenant; $2 documents, $3 versions, $4 models, $5 strategies, $6 the served strategies
-- each write replaces (NULL: none). replace_version_chunks (sink.sql) for every version of
-- one tenant of the group (a statement per tenant: the tenant's partition of knowledge_chunk
-- is picked when the statement is planned): what the version held of its generation
-- before, or of the served set the write replaces, before the new sets are COPYed in. The
-- document of each deleted row comes back, for the log of replaced sets. Usually deletes
-- nothing (first runs): one probe of the primary key per version.
DELETE FROM knowledge_chunk c
 USING unnest($2::uuid[], $3::integer[], $4::text[], $5::text[], $6::text[])
       AS v (document_id, version_number, embedding_model, chunking_strategy, replaced)
 WHERE c.tenant_id = $1
   AND c.document_id = v.document_id
   AND c.version_number = v.version_number
   AND c.embedding_model = v.embedding_model
   AND (c.chunking_strategy = v.chunking_strategy OR c.chunking_strategy = v.replaced)
RETURNING c.document_id
