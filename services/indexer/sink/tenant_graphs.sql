-- A large tenant's own HNSW graph (services/indexer/sink/tenant_graphs.py).

-- name: large_tenants
-- $1 model (NULL: any), $2 chunks, $3 tenants (NULL: every tenant). Tenants whose current
-- search versions (of model $1) hold at least $2 chunks (the chunk counts each switch writes
-- on the pointer), the largest first, with the partition of knowledge_chunk that holds them.
-- With a model: the tenants of a served model, every few minutes. Without: the tenants a new
-- generation (`kb index generations create`) gives a graph of their own before its backfill
-- starts, while it has no chunk yet (an empty partial index, then kept as the backfill
-- inserts), once per create. A full pass over the pointers (one row per document): never
-- per request.
SELECT s.tenant_id, s.chunks, p.relname AS partition
  FROM (SELECT tenant_id, sum(coalesce(chunk_count, 0)) AS chunks
          FROM document_search_version
         WHERE ($1::text IS NULL OR embedding_model = $1)
           AND ($3::text[] IS NULL OR tenant_id = ANY ($3::text[]))
         GROUP BY tenant_id
        HAVING sum(coalesce(chunk_count, 0)) >= $2) s
 CROSS JOIN LATERAL (
        SELECT c.relname
          FROM pg_class c
         WHERE c.oid = (SELECT k.tableoid FROM knowledge_chunk k
                         WHERE k.tenant_id = s.tenant_id LIMIT 1)) p
 ORDER BY s.chunks DESC, s.tenant_id

-- name: try_tenant_graphs_lock
-- One builder of a model's tenant graphs at a time, across processes: tried, never waited
-- for (a session waiting in pg_advisory_lock holds a snapshot that the holder's CREATE INDEX
-- CONCURRENTLY would wait for). Session-level, released by release_tenant_graphs_lock.
SELECT pg_try_advisory_lock(hashtextextended('kb.tenant_graphs:' || $1::text, 0))

-- name: release_tenant_graphs_lock
SELECT pg_advisory_unlock(hashtextextended('kb.tenant_graphs:' || $1::text, 0))

-- name: graph_models
-- The models of the indexers' rounds, with their dimension: each that a search pointer
-- names (one row per document: a pass over the pointers per registered model, every few
-- minutes, beside large_tenants' own) or a live search generation embeds with.
SELECT embedding_model, dimension
  FROM search_generation
 WHERE state <> 'RETIRED'
 UNION
SELECT g.embedding_model, g.dimension
  FROM (SELECT DISTINCT embedding_model, dimension FROM index_generation) g
 WHERE EXISTS (SELECT 1 FROM document_search_version p WHERE p.embedding_model = g.embedding_model)
 ORDER BY embedding_model
