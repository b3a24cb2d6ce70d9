-- `kb index partition-graphs drop` (services/indexer/maintenance/partition_graphs.py).

-- name: models
-- Every model a partitioned index may have been built for: each the indexers registered, and
-- each of a live search generation (one `kb index generations create` built it for).
SELECT embedding_model FROM index_generation
 UNION
SELECT embedding_model FROM search_generation WHERE state <> 'RETIRED'
 ORDER BY embedding_model

-- name: unattached_parts
-- $1 the model's index name: the parts of it on knowledge_chunk's partitions ($1_pNN) that
-- are attached to no parent -- left by a build interrupted before its ATTACH, or after the
-- parent was dropped. The tenants' graphs ($1_t...) are not parts.
SELECT c.relname AS index_name, t.relname AS partition
  FROM pg_class c
  JOIN pg_index i ON i.indexrelid = c.oid
  JOIN pg_class t ON t.oid = i.indrelid
 WHERE c.relkind = 'i'
   AND c.relname LIKE $1 || '\_p%'
   AND c.relnamespace = (SELECT relnamespace FROM pg_class WHERE oid = 'knowledge_chunk'::regclass)
   AND NOT EXISTS (SELECT 1 FROM pg_inherits h WHERE h.inhrelid = c.oid)
 ORDER BY c.relname

-- name: set_session_lock_timeout
-- For the DROP INDEX CONCURRENTLY of unattached parts, which runs in no transaction (so not
-- SET LOCAL); reset_lock_timeout sets it back.
SELECT set_config('lock_timeout', $1::text, false)

-- name: reset_lock_timeout
RESET lock_timeout
