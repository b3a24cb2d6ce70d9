-- The indexer's sink (services/indexer/sink/pgvector.py). The write queries run inside the
-- fenced `complete` transaction (services/indexer/queue/store_pg.py): the task row is already
-- locked by the fenced UPDATE, so no takeover can commit between them and the commit.

-- name: create_staging
-- A per-transaction staging table shaped like knowledge_chunk_staging (migration 0006),
-- dropped at commit or rollback: nothing outlives the transaction on the pooled connection.
-- Temporary tables write no WAL, so the COPY into it is cheap. Completions committed as a
-- group (services/indexer/queue/completions.py) share the transaction: the first creates
-- the table, the next ones find it, emptied by insert_staged_chunks.
CREATE TEMP TABLE IF NOT EXISTS knowledge_chunk_staging (LIKE knowledge_chunk_staging)
    ON COMMIT DROP

-- name: insert_staged_chunks
-- $1 tenant, $2 document, $3 version, $4 model, $5 strategy, $6 dimension.
-- `knowledge_chunk_staging` is the temporary table of create_staging (it shadows the
-- permanent one); its rows are deleted as they are moved, so the next write of the same
-- transaction starts from an empty table. Idempotent: a chunk already there (same key: the
-- chunk id is derived from version, strategy, ordinal, heading path and content digest) is
-- left as it is, so a re-run writes the identical set. DO NOTHING takes no lock on existing
-- rows, and two writers of one version cannot race: only the lease holder gets here.
WITH staged AS (
    DELETE FROM knowledge_chunk_staging
    RETURNING chunk_id, ordinal, heading_path, text, content_digest, embedding
)
INSERT INTO knowledge_chunk (tenant_id, document_id, version_number, embedding_model,
                             chunking_strategy, chunk_id, ordinal, heading_path, text,
                             content_digest, embedding_dimension, embedding)
SELECT $1::text, $2::uuid, $3::integer, $4::text, $5::text, s.chunk_id, s.ordinal,
       s.heading_path, s.text, s.content_digest, $6::integer, s.embedding
  FROM staged s
ON CONFLICT DO NOTHING

-- name: switch_search_version
-- $1 tenant, $2 document, $3 version, $4 model, $5 strategy, $6 chunk count, $7 task, $8 now.
-- Forward only: a pointer at this or a newer version is left alone (no row returned), so a
-- task for an older version still succeeds but switches nothing. Concurrent switches of one
-- document serialise on the pointer row: ON CONFLICT locks it and evaluates the WHERE
-- against its latest committed version, not our snapshot's. `old` (PostgreSQL 18 RETURNING)
-- is the row before the update: NULL when this is the document's first pointer.
INSERT INTO document_search_version AS s (tenant_id, document_id, version_number,
                                          embedding_model, chunking_strategy, chunk_count,
                                          task_id, switched_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, coalesce($8::timestamptz, now()))
ON CONFLICT (tenant_id, document_id) DO UPDATE
   SET version_number = EXCLUDED.version_number,
       embedding_model = EXCLUDED.embedding_model,
       chunking_strategy = EXCLUDED.chunking_strategy,
       chunk_count = EXCLUDED.chunk_count,
       task_id = EXCLUDED.task_id,
       switched_at = EXCLUDED.switched_at
 WHERE s.version_number < EXCLUDED.version_number
RETURNING old.version_number AS previous_version, new.switched_at

-- name: retire_superseded_chunks
-- $1 tenant, $2 document, $3 version (the task's), $4 model, $5 strategy.
-- Run right after switch_search_version, in the same fenced transaction, whether or not the
-- pointer moved: deletes the document's chunks of this generation (same model AND strategy)
-- that the pointer has left behind for good, i.e. older than the version it serves, and
-- never newer than this task's version. So:
--   * the pointer moved to v: the chunks of versions < v go;
--   * the pointer already serves a newer version w of this generation (this task finished
--     late): versions <= v go, this task's own chunks with them (nothing will serve them);
--   * the pointer serves another generation (this task builds a generation beside the
--     served one), or no pointer: nothing goes. Other generations' chunks never go here.
-- Why it is safe:
--   * An in-flight search runs in one REPEATABLE READ read-only transaction (search_pg):
--     if its snapshot predates this commit it still sees the pointer at the old version AND
--     the old version's rows (MVCC keeps deleted rows for older snapshots, and VACUUM
--     removes neither heap rows nor their HNSW/GIN entries while such a snapshot lives); a
--     snapshot taken after the commit sees the new pointer. Never half a version.
--   * The pointer only moves forward (the forward-only trigger, switch_search_version's
--     WHERE), so a version older than the pointer's is never served again.
--   * Races between versions of one document: switch_search_version locks the pointer row
--     (ON CONFLICT DO UPDATE locks the row even when its WHERE is false) until commit, so
--     the completions of one document run this statement one at a time, each with a fresh
--     READ COMMITTED snapshot taken after the lock: every chunk an earlier completion
--     committed is seen; one that has not committed yet still has to take the lock, and
--     then retires its own chunks if it turns out superseded. A newer version's rows are
--     never touched ($3 bounds the range), staged ones (knowledge_chunk_stream) neither.
--   * Embedding reuse (known_embeddings) takes any version's chunks: the served version's
--     rows stay, so unchanged content keeps being reused (content that exists only in a
--     retired version is embedded again if it comes back).
-- Cost: one document's chunks, through the primary key prefix (tenant_id, document_id,
-- version_number, embedding_model) of the tenant's partition; the strategy is a filter.
-- Deleting only marks the rows: the HNSW and GIN entries go at the partition's next VACUUM.
DELETE FROM knowledge_chunk c
 USING document_search_version s
 WHERE s.tenant_id = $1
   AND s.document_id = $2
   AND s.embedding_model = $4
   AND s.chunking_strategy = $5
   AND c.tenant_id = $1
   AND c.document_id = $2
   AND c.version_number < s.version_number
   AND c.version_number <= $3::integer
   AND c.embedding_model = $4
   AND c.chunking_strategy = $5

-- name: known_embeddings
-- $1 tenant, $2 model, $3 strategy, $4 dimension, $5 digests. One probe of
-- knowledge_chunk_reuse per digest, tenant-scoped; any version's chunk will do (the same
-- input embeds the same under one model), so one row per digest.
SELECT DISTINCT ON (content_digest) content_digest, embedding
  FROM knowledge_chunk
 WHERE tenant_id = $1
   AND embedding_model = $2
   AND chunking_strategy = $3
   AND content_digest = ANY($5::bytea[])
   AND embedding_dimension = $4
 ORDER BY content_digest

-- name: try_generation_lock
-- Session-level and tried, not waited for: a session blocked in pg_advisory_lock holds a
-- snapshot, and CREATE INDEX CONCURRENTLY in the lock holder waits for every older snapshot
-- to go away -- the two would wait for each other. Released by release_generation_lock.
SELECT pg_try_advisory_lock(hashtextextended('kb.index_generation:' || $1::text, 0))

-- name: release_generation_lock
SELECT pg_advisory_unlock(hashtextextended('kb.index_generation:' || $1::text, 0))

-- name: register_generation
-- $1 model, $2 strategy, $3 dimension, $4 ANN index name. Returns the dimension the model is
-- registered with (its first generation's): a different one is a configuration error, since
-- the model's one ANN index casts every embedding of the model to that dimension.
WITH registered AS (
    INSERT INTO index_generation (embedding_model, chunking_strategy, dimension, ann_index_name)
    SELECT $1, $2, $3, $4
     WHERE NOT EXISTS (SELECT 1 FROM index_generation WHERE embedding_model = $1)
        OR EXISTS (SELECT 1 FROM index_generation
                    WHERE embedding_model = $1 AND dimension = $3)
    ON CONFLICT (embedding_model, chunking_strategy) DO NOTHING
)
SELECT coalesce(
    (SELECT dimension FROM index_generation WHERE embedding_model = $1 LIMIT 1), $3::integer
) AS dimension

-- name: ann_index_state
-- Whether an ANN index ($1) exists and is valid: the model's is valid once every partition's
-- part of it is built and attached (until then queries do not use it); a tenant's graph
-- (tenant_graphs) is INVALID when its CREATE INDEX CONCURRENTLY was interrupted. No row:
-- there is none.
SELECT i.indisvalid AS valid
  FROM pg_class c
  JOIN pg_index i ON i.indexrelid = c.oid
 WHERE c.relname = $1
   AND c.relnamespace = (SELECT relnamespace FROM pg_class WHERE oid = 'knowledge_chunk'::regclass)

-- name: knowledge_chunk_partitions
-- The partitions of knowledge_chunk (migrations/0014), each of which holds its part of every
-- model's ANN index.
SELECT c.relname AS partition
  FROM pg_inherits i
  JOIN pg_class c ON c.oid = i.inhrelid
 WHERE i.inhparent = 'knowledge_chunk'::regclass
 ORDER BY c.relname

-- name: ann_partition_index_state
-- $1 one partition's part of a model's ANN index, $2 the model's index: whether the part
-- exists, is valid (an interrupted CREATE INDEX CONCURRENTLY leaves it INVALID) and is
-- attached to the model's index. No row: it does not exist.
SELECT i.indisvalid AS valid,
       EXISTS (SELECT 1
                 FROM pg_inherits h
                 JOIN pg_class p ON p.oid = h.inhparent
                WHERE h.inhrelid = c.oid
                  AND p.relname = $2
                  AND p.relnamespace = c.relnamespace) AS attached
  FROM pg_class c
  JOIN pg_index i ON i.indexrelid = c.oid
 WHERE c.relname = $1
   AND c.relnamespace = (SELECT relnamespace FROM pg_class WHERE oid = 'knowledge_chunk'::regclass)

-- name: list_generations
SELECT embedding_model, chunking_strategy, dimension, ann_index_name, created_at
  FROM index_generation
 ORDER BY created_at, embedding_model, chunking_strategy

-- name: start_index_build
-- Session-level, for an HNSW build (sink_pgvector.index_build_session): no statement timeout
-- and $1 of maintenance_work_mem; the previous values come back, for end_index_build, which
-- the caller runs before the connection returns to the pool (the indexer's pool does not
-- reset sessions).
SELECT current_setting('statement_timeout') AS statement_timeout,
       current_setting('maintenance_work_mem') AS maintenance_work_mem,
       set_config('statement_timeout', '0', false) AS new_statement_timeout,
       set_config('maintenance_work_mem', $1::text, false) AS new_maintenance_work_mem

-- name: end_index_build
-- $1, $2: start_index_build's statement_timeout and maintenance_work_mem.
SELECT set_config('statement_timeout', $1::text, false),
       set_config('maintenance_work_mem', $2::text, false)

-- name: set_local_statement_timeout
-- Transaction-level (SET LOCAL): gone at commit or rollback, nothing left on the connection.
SELECT set_config('statement_timeout', $1::text, true)

-- ---------------------------------------------------------------------------------------
-- Streamed documents (services/indexer/sink/stream.py, migration 0013): slices of a large
-- document staged under their attempt, moved into the index by the fenced completion.

-- name: lock_stream_lease
-- $1 task, $2 owner, $3 lease_attempt, $4 now. The fence of one slice's transaction: the
-- same condition as complete_task, and FOR SHARE holds the task row until the slice
-- commits. A takeover (an UPDATE of the row) therefore waits for the slice; once it has
-- committed, this attempt's next slice finds no row and stops. So the rows of an attempt
-- are all committed before its successor can start (and clean them up), and none can
-- arrive later.
SELECT task_id
  FROM index_task
 WHERE task_id = $1
   AND status = 'RUNNING'
   AND lease_owner = $2
   AND attempts = $3
   AND lease_until > coalesce($4::timestamptz, now())
   FOR SHARE

-- name: delete_stale_stream
-- $1 task, $2 lease_attempt. Rows left by the task's earlier attempts (lost or crashed
-- mid-stream): run by the first slice of a new attempt, under its fence.
DELETE FROM knowledge_chunk_stream WHERE task_id = $1 AND lease_attempt <> $2

-- name: delete_attempt_stream
-- $1 task, $2 lease_attempt. An attempt that failed gives up its own rows.
DELETE FROM knowledge_chunk_stream WHERE task_id = $1 AND lease_attempt = $2

-- name: count_stream
-- $1 task, $2 lease_attempt.
SELECT count(*) FROM knowledge_chunk_stream WHERE task_id = $1 AND lease_attempt = $2

-- name: move_streamed_chunks
-- $1 task, $2 lease_attempt, $3 tenant, $4 document, $5 version, $6 model, $7 strategy,
-- $8 dimension. Inside the fenced complete: every staged row of the task leaves the
-- staging table, and this attempt's rows enter the index, idempotently as
-- insert_staged_chunks does (rows of other attempts are dropped, never indexed).
WITH moved AS (
    DELETE FROM knowledge_chunk_stream WHERE task_id = $1
    RETURNING lease_attempt, chunk_id, ordinal, heading_path, text, content_digest, embedding
)
INSERT INTO knowledge_chunk (tenant_id, document_id, version_number, embedding_model,
                             chunking_strategy, chunk_id, ordinal, heading_path, text,
                             content_digest, embedding_dimension, embedding)
SELECT $3::text, $4::uuid, $5::integer, $6::text, $7::text, m.chunk_id, m.ordinal,
       m.heading_path, m.text, m.content_digest, $8::integer, m.embedding
  FROM moved m
 WHERE m.lease_attempt = $2
ON CONFLICT DO NOTHING
