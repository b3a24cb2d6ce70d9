-- The indexer's sink (services/indexer/sink/pgvector.py). The write queries run inside the
-- fenced `complete` transaction (services/indexer/queue/store_pg.py): the task row is already
-- locked by the fenced UPDATE, so no takeover can commit between them and the commit.

-- name: lock_search_pointer
-- $1 tenants, $2 documents: one (tenant, document) pair per element (one for a write of its
-- own; a group written together has several: together.py); $3 now; $4 the write's statement
-- timeout (ms), set for the rest of the transaction (SET LOCAL: the statements after this one
-- insert the rows, whose HNSW graphs take time by the row; this one and the generation's
-- lock before it wait under the pool's). First each document's
-- mark for the collector (gc.sql: mark_document, whose lock comes before the pointer's and
-- any chunk row's): `marked` is read by a one-time filter, which the executor evaluates
-- before the scan below returns its first row, so every mark is taken before any pointer
-- row is locked -- the order of two statements, in one round trip (BENCHMARKS.md,
-- "Database CPU per document"). Then each document's search pointer, locked until commit,
-- before the write deletes or inserts anything of the document, so that what it
-- deletes and inserts is decided against the pointer as it will stay until this transaction
-- commits. Under READ COMMITTED, FOR UPDATE waits for a concurrent completion of the same
-- document that holds the row and then returns the row as that one committed it (not as our
-- snapshot saw it). No row: the document has no pointer yet (or it was deleted); nothing is
-- locked then, and concurrent first switches serialise on switch_search_version's unique
-- index instead. The rows are locked in (tenant, document) order, the order every group
-- takes them in: FOR UPDATE locks the rows as they leave the sort (the plan's LockRows node
-- sits above it).
-- deleted_at: the pointer is a tombstone (the document was deleted, migration 0030): the
-- write refuses to go on (together.py: DOCUMENT_DELETED), whatever its version. Read under
-- the row lock, so a delete that committed while this waited is seen.
WITH marked AS (
    -- include: mark_document from services/indexer/gc/gc.sql
    RETURNING 1
), timeout AS (
    SELECT set_config('statement_timeout', $4::text, true) AS statement_timeout
)
SELECT s.tenant_id, s.document_id, s.version_number, s.embedding_model, s.chunking_strategy,
       s.chunk_count, s.deleted_at
  FROM document_search_version s
 WHERE (s.tenant_id, s.document_id) IN (SELECT k.tenant_id, k.document_id
                                           FROM unnest($1::text[], $2::uuid[])
                                                AS k (tenant_id, document_id))
   AND (SELECT count(*) FROM marked) >= 0
   AND (SELECT statement_timeout FROM timeout) IS NOT NULL
 ORDER BY s.tenant_id, s.document_id
   FOR UPDATE OF s

-- name: replace_version_chunks
-- $1 tenant; $2 documents, $3 versions, $4 models, $5 strategies (the tasks'), $6 the served
-- strategy each write replaces (version.py: replaced_strategy -- the pointer serves this
-- version under this model and chunk settings; NULL: it replaces nothing, or the pointer
-- names no strategy): one array element per version of that tenant written (a statement
-- per tenant: the tenant's partition of knowledge_chunk is picked when it is planned). The
-- document of each deleted row comes back, for the log of replaced sets. Run after
-- lock_search_pointer and just before the new sets are COPYed into knowledge_chunk
-- (together.py): deletes each version's chunks of its model among
--   * this task's strategy: an earlier run's set of this generation, which the COPY writes
--     again (same ids: the chunk id is derived from version, strategy, ordinal, heading path
--     and content digest), so the COPY never meets a row of its own key;
--   * the served strategy $6: the chunking the pointer serves now, which this run replaces
--     (a re-run after a chunker upgrade, `kb index check --repair`: the same settings, newer
--     code); switch_search_version then rewrites the pointer's strategy and chunk count in
--     this transaction.
-- So after a re-run the version holds exactly one chunk set of this model for the pointer
-- to name: never the union of two runs, which search would serve as near-duplicates and
-- whose count would never match the pointer's.
-- Why readers never see an empty or a mixed set: the pointer row is locked (no other
-- completion of the document runs this meanwhile: only the lease holder writes a version),
-- the deletes, the new rows and the pointer's rewrite commit together, and a search reads in
-- one snapshot (before: the old pointer and the old rows, which MVCC keeps for it; after:
-- the new ones), joining the pointer's strategy (current_version_chunks), so rows of any
-- other strategy left at the version are never served. Other generations' chunks (another
-- model, other settings: built beside the served one) are left alone.
-- Why not keep the rows a re-run would write unchanged: a re-run is rare (repairs), a
-- version's first run is the rule, and finding "what the new set holds" needed the set in a
-- temporary table -- created, filled and dropped in every completion, catalog rows and all,
-- which cost more than the chunks' own insert for a short document (BENCHMARKS.md).
-- Cost: one range of the primary key (tenant, document, version, model) of the tenant's
-- partition, usually empty (a version's first run).
DELETE FROM knowledge_chunk c
 USING unnest($2::uuid[], $3::integer[], $4::text[], $5::text[], $6::text[])
       AS v (document_id, version_number, embedding_model, chunking_strategy, replaced)
 WHERE c.tenant_id = $1
   AND c.document_id = v.document_id
   AND c.version_number = v.version_number
   AND c.embedding_model = v.embedding_model
   AND (c.chunking_strategy = v.chunking_strategy OR c.chunking_strategy = v.replaced)
RETURNING c.document_id

-- name: switch_search_version
-- $1 tenants, $2 documents: the documents among these that had no pointer when
-- lock_search_pointer ran, whose first-pointer lock (served_acl.sql: lock_first_pointer,
-- standing in for the row a publish would otherwise wait on) is taken before any pointer
-- is written: `first_pointer` is read by a one-time filter, evaluated before the INSERT's
-- first row (one round trip for what were two statements, BENCHMARKS.md).
-- $3 tenants, $4 documents, $5 versions, $6 models, $7 strategies, $8 chunk counts, $9 tasks,
-- one element per completion (one for a write of its own, several for a group written
-- together: together.py, in (tenant, document) order); $10 now; $11 whether these writes
-- replace their served chunk set (version.py: ServedPointer.replaces, decided on the row
-- lock_search_pointer holds: same version, model and chunk settings; the same for every
-- row: a group runs the statement once for those that do and once for those that do not).
-- Forward only: a pointer at a newer version is left alone (no row returned), so a task for
-- an older version still succeeds but switches nothing. At the served version, a write that
-- replaces the served set rewrites the pointer when it names another set (another strategy
-- -- newer code -- or count: replace_version_chunks replaced the rows in this transaction);
-- an identical re-run leaves it as it is. Another generation's task at the served version
-- (another model or other chunk settings, built beside the served one) switches nothing.
-- A document whose pointer was deleted is not given one below the version it last served
-- (document_search_version_high_water, migration 0021): its trigger would refuse the insert
-- and fail the task; this WHERE skips it, and the task succeeds without switching.
-- Concurrent switches of one document serialise on the pointer row (lock_search_pointer
-- locked it; ON CONFLICT evaluates the WHERE against its latest committed version, not our
-- snapshot's). `old` (PostgreSQL 18 RETURNING) is the row before the update: NULL when this
-- is the document's first pointer. A previous_version other than the row's version means the
-- pointer moved to this version: the sink then makes its ACL the served one in this
-- transaction (services/runtime/tenancy/served_acl.sql: apply_served_acl, issue 29 item 1).
-- One row back per pointer that changed, with its tenant and document, and the ingest
-- command whose publish created the task (migration 0033; NULL: none), for the event.
WITH first_pointer AS (
    -- include: lock_first_pointer from services/runtime/tenancy/served_acl.sql
)
INSERT INTO document_search_version AS s (tenant_id, document_id, version_number,
                                          embedding_model, chunking_strategy, chunk_count,
                                          task_id, switched_at)
SELECT w.tenant_id, w.document_id, w.version_number, w.embedding_model, w.chunking_strategy,
       w.chunk_count, w.task_id, coalesce($10::timestamptz, now())
  FROM unnest($3::text[], $4::uuid[], $5::integer[], $6::text[], $7::text[], $8::integer[],
              $9::uuid[])
       WITH ORDINALITY AS w (tenant_id, document_id, version_number, embedding_model,
                             chunking_strategy, chunk_count, task_id, n)
 WHERE NOT EXISTS (SELECT 1
                     FROM document_search_version_high_water h
                    WHERE h.tenant_id = w.tenant_id
                      AND h.document_id = w.document_id
                      AND h.version_number > w.version_number)
   AND (SELECT count(*) FROM first_pointer) >= 0
 ORDER BY w.n
ON CONFLICT (tenant_id, document_id) DO UPDATE
   SET version_number = EXCLUDED.version_number,
       embedding_model = EXCLUDED.embedding_model,
       chunking_strategy = EXCLUDED.chunking_strategy,
       chunk_count = EXCLUDED.chunk_count,
       task_id = EXCLUDED.task_id,
       switched_at = EXCLUDED.switched_at
 WHERE s.version_number < EXCLUDED.version_number
    OR ($11::boolean
        AND s.version_number = EXCLUDED.version_number
        AND s.embedding_model = EXCLUDED.embedding_model
        AND (s.chunking_strategy, s.chunk_count)
            IS DISTINCT FROM (EXCLUDED.chunking_strategy, EXCLUDED.chunk_count))
RETURNING new.tenant_id, new.document_id, old.version_number AS previous_version,
          new.switched_at,
          (SELECT c.command_id
             FROM ingest_command AS c
            WHERE c.tenant_id = new.tenant_id AND c.task_id = new.task_id
            ORDER BY c.applied_at, c.command_id
            LIMIT 1) AS command_id

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
-- $1 model, $2 strategy, $3 dimension, $4 ANN index name, $5 the versions of the code that
-- chunks (jsonb, chunking_code.py; NULL: not known), $6 now. Returns the dimension the model
-- is registered with (its first generation's): a different one is a configuration error,
-- since the model's HNSW graphs (index/ann.py) cast every embedding of the model to that
-- dimension.
-- A generation registered before is registered again: registered_at says which generation
-- of a model the indexers started last chunk with (`kb index check`: chunked by older code).
WITH registered AS (
    INSERT INTO index_generation AS g (embedding_model, chunking_strategy, dimension,
                                       ann_index_name, chunking_code, registered_at)
    SELECT $1, $2, $3, $4, $5::jsonb, coalesce($6::timestamptz, now())
     WHERE NOT EXISTS (SELECT 1 FROM index_generation WHERE embedding_model = $1)
        OR EXISTS (SELECT 1 FROM index_generation
                    WHERE embedding_model = $1 AND dimension = $3)
    ON CONFLICT (embedding_model, chunking_strategy) DO UPDATE
       SET registered_at = EXCLUDED.registered_at,
           chunking_code = coalesce(EXCLUDED.chunking_code, g.chunking_code)
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

-- name: set_local_drop_timeouts
-- Transaction-level (SET LOCAL), for the DROP INDEX of a model's partitioned ANN index
-- (pgvector.PartitionedDrop): $1 (a duration, '2s') for any one lock it waits for, twice
-- that for the statement -- lock_timeout applies per lock, and the DROP waits for each
-- partition's in turn while it holds knowledge_chunk's ACCESS EXCLUSIVE lock.
SELECT set_config('lock_timeout', $1::text, true) AS lock_timeout,
       set_config('statement_timeout',
                  (ceil(extract(epoch FROM 2 * $1::text::interval) * 1000))::bigint::text,
                  true) AS statement_timeout

-- name: knowledge_chunk_partitions
-- The partitions of knowledge_chunk (migrations/0014): a model's partitioned ANN index, when
-- built (KB_INDEXER_PARTITION_GRAPHS), has a part on each.
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
-- Session-level, for an HNSW build (pgvector.index_build_session): no statement timeout
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

-- name: replace_streamed_version_chunks
-- replace_version_chunks for a streamed document: $1 tenant, $2 document, $3 version,
-- $4 model, $5 strategy, $6 the served strategy (or NULL), as there; the new set is the
-- rows task $7 staged under its attempt $8, which move_streamed_chunks moves in next.
DELETE FROM knowledge_chunk c
 WHERE c.tenant_id = $1
   AND c.document_id = $2
   AND c.version_number = $3
   AND c.embedding_model = $4
   AND (c.chunking_strategy = $5 OR c.chunking_strategy = $6::text)
   AND NOT EXISTS (
         SELECT 1
           FROM knowledge_chunk_stream n
          WHERE n.task_id = $7
            AND n.lease_attempt = $8
            AND n.chunk_id = c.chunk_id
            AND c.chunking_strategy = $5)

-- name: move_streamed_chunks
-- $1 task, $2 lease_attempt, $3 tenant, $4 document, $5 version, $6 model, $7 strategy,
-- $8 dimension. Inside the fenced complete, after replace_streamed_version_chunks: every
-- staged row of the task leaves the staging table, and this attempt's rows enter the index
-- as insert_staged_chunks does (rows of other attempts are dropped, never indexed).
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
