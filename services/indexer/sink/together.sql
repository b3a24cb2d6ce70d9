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

-- name: switch_search_versions
-- $1 tenants, $2 documents, $3 versions, $4 models, $5 strategies, $6 chunk counts, $7 tasks,
-- one element per completion; $8 now; $9 whether these writes replace their served chunk set
-- (the same for every row: the caller runs the statement once for those that do and once for
-- those that do not). switch_search_version (sink.sql says why each condition) for every
-- document of the group whose generation serves its tenant, in the order given ((tenant,
-- document) order): forward only, the high-water mark respected, a rewrite at the served
-- version only for a write that replaces its set. One row back per pointer that changed:
-- the tenant and document, the version it served before (NULL: its first pointer) and the
-- switch's time.
INSERT INTO document_search_version AS s (tenant_id, document_id, version_number,
                                          embedding_model, chunking_strategy, chunk_count,
                                          task_id, switched_at)
SELECT w.tenant_id, w.document_id, w.version_number, w.embedding_model, w.chunking_strategy,
       w.chunk_count, w.task_id, coalesce($8::timestamptz, now())
  FROM unnest($1::text[], $2::uuid[], $3::integer[], $4::text[], $5::text[], $6::integer[],
              $7::uuid[])
       WITH ORDINALITY AS w (tenant_id, document_id, version_number, embedding_model,
                             chunking_strategy, chunk_count, task_id, n)
 WHERE NOT EXISTS (SELECT 1
                     FROM document_search_version_high_water h
                    WHERE h.tenant_id = w.tenant_id
                      AND h.document_id = w.document_id
                      AND h.version_number > w.version_number)
 ORDER BY w.n
ON CONFLICT (tenant_id, document_id) DO UPDATE
   SET version_number = EXCLUDED.version_number,
       embedding_model = EXCLUDED.embedding_model,
       chunking_strategy = EXCLUDED.chunking_strategy,
       chunk_count = EXCLUDED.chunk_count,
       task_id = EXCLUDED.task_id,
       switched_at = EXCLUDED.switched_at
 WHERE s.version_number < EXCLUDED.version_number
    OR ($9::boolean
        AND s.version_number = EXCLUDED.version_number
        AND s.embedding_model = EXCLUDED.embedding_model
        AND (s.chunking_strategy, s.chunk_count)
            IS DISTINCT FROM (EXCLUDED.chunking_strategy, EXCLUDED.chunk_count))
RETURNING new.tenant_id, new.document_id, old.version_number AS previous_version,
          new.switched_at
