-- A large tenant's own HNSW graph (services/indexer/sink/tenant_graphs.py).

-- name: large_tenants
-- $1 model (NULL: any), $2 chunks, $3 tenants (NULL: every tenant). Tenants whose current
-- search versions (of model $1) hold at least $2 chunks (the chunk counts each switch writes
-- on the pointer), the largest first.
-- With a model: the tenants of a served model (`kb index partition-graphs drop`'s check; the
-- indexers' round reads every model's at once: large_tenants_by_model). Without: the tenants a new
-- generation (`kb index generations create`) gives a graph of their own before its backfill
-- starts, while it has no chunk yet (an empty partial index, then kept as the backfill
-- inserts), once per create. A full pass over the pointers (one row per document): never
-- per request.
SELECT s.tenant_id, s.chunks
  FROM (SELECT tenant_id, sum(coalesce(chunk_count, 0)) AS chunks
          FROM document_search_version
         WHERE ($1::text IS NULL OR embedding_model = $1)
           AND ($3::text[] IS NULL OR tenant_id = ANY ($3::text[]))
         GROUP BY tenant_id
        HAVING sum(coalesce(chunk_count, 0)) >= $2) s
 ORDER BY s.chunks DESC, s.tenant_id

-- name: try_tenant_graphs_lock
-- One builder of a model's tenant graphs at a time, across processes: tried, never waited
-- for (a session waiting in pg_advisory_lock holds a snapshot that the holder's CREATE INDEX
-- CONCURRENTLY would wait for). Session-level, released by release_tenant_graphs_lock.
SELECT pg_try_advisory_lock(hashtextextended('kb.tenant_graphs:' || $1::text, 0))

-- name: release_tenant_graphs_lock
SELECT pg_advisory_unlock(hashtextextended('kb.tenant_graphs:' || $1::text, 0))

-- name: large_tenants_by_model
-- $1 chunks. The indexers' round, every few minutes: the tenants of at least $1 chunks of
-- each model their current search versions hold, every model in one pass over the pointers
-- (one row per document), by model then the largest first (the model's dimension is read
-- apart, model_dimension; a tenant's partition when its graph is built, tenant_partition).
-- A model no large tenant serves costs nothing more.
SELECT s.embedding_model, s.tenant_id, s.chunks
  FROM (SELECT embedding_model, tenant_id, sum(coalesce(chunk_count, 0)) AS chunks
          FROM document_search_version
         GROUP BY 1, 2
        HAVING sum(coalesce(chunk_count, 0)) >= $1) s
 ORDER BY s.embedding_model, s.chunks DESC, s.tenant_id

-- name: model_dimension
-- $1 model: its dimension -- the registered generation's (index_generation), else a live
-- search generation's (a retired one may have had another); no row: a model without a
-- generation, which has no graph to build.
SELECT g.dimension
  FROM (SELECT 1 AS rank, dimension FROM index_generation WHERE embedding_model = $1
         UNION ALL
        SELECT 2, dimension FROM search_generation
         WHERE embedding_model = $1 AND state <> 'RETIRED') g
 ORDER BY g.rank
 LIMIT 1

-- name: tenant_partition
-- $1 tenant: the partition of knowledge_chunk that holds its chunks (migrations/0014), on
-- which its graph is built. Read once a build, by one of its rows (the tenant's index).
SELECT c.relname
  FROM pg_class c
 WHERE c.oid = (SELECT k.tableoid FROM knowledge_chunk k WHERE k.tenant_id = $1 LIMIT 1)
