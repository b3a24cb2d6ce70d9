-- A large tenant's own HNSW graph (services/indexer/tenant_graphs.py).

-- name: large_tenants
-- Tenants whose current search versions of model $1 hold at least $2 chunks (the chunk
-- counts each switch writes on the pointer), the largest first, with the partition of
-- knowledge_chunk that holds them. A full pass over the pointers (one row per document):
-- run every few minutes, not per request.
SELECT s.tenant_id, s.chunks, p.relname AS partition
  FROM (SELECT tenant_id, sum(coalesce(chunk_count, 0)) AS chunks
          FROM document_search_version
         WHERE embedding_model = $1
         GROUP BY tenant_id
        HAVING sum(coalesce(chunk_count, 0)) >= $2) s
 CROSS JOIN LATERAL (
        SELECT c.relname
          FROM pg_class c
         WHERE c.oid = (SELECT k.tableoid FROM knowledge_chunk k
                         WHERE k.tenant_id = s.tenant_id LIMIT 1)) p
 ORDER BY s.chunks DESC, s.tenant_id

-- name: index_validity
-- $1 an index of knowledge_chunk's schema: true (valid), false (INVALID: an interrupted
-- CREATE INDEX CONCURRENTLY), no row (none).
SELECT i.indisvalid AS valid
  FROM pg_class c
  JOIN pg_index i ON i.indexrelid = c.oid
 WHERE c.relname = $1
   AND c.relnamespace = (SELECT relnamespace FROM pg_class WHERE oid = 'knowledge_chunk'::regclass)

-- name: try_tenant_graphs_lock
-- One builder of a model's tenant graphs at a time, across processes: tried, never waited
-- for (a session waiting in pg_advisory_lock holds a snapshot that the holder's CREATE INDEX
-- CONCURRENTLY would wait for). Session-level, released by release_tenant_graphs_lock.
SELECT pg_try_advisory_lock(hashtextextended('kb.tenant_graphs:' || $1::text, 0))

-- name: release_tenant_graphs_lock
SELECT pg_advisory_unlock(hashtextextended('kb.tenant_graphs:' || $1::text, 0))

-- name: build_settings
-- Session-level, for the builds only (no statement timeout, the build's memory); the
-- previous values come back, for restore_build_settings.
SELECT current_setting('statement_timeout') AS statement_timeout,
       current_setting('maintenance_work_mem') AS maintenance_work_mem,
       set_config('statement_timeout', '0', false) AS new_statement_timeout,
       set_config('maintenance_work_mem', $1::text, false) AS new_maintenance_work_mem

-- name: restore_build_settings
SELECT set_config('statement_timeout', $1::text, false),
       set_config('maintenance_work_mem', $2::text, false)
