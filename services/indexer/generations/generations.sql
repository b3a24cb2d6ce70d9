-- `kb index generations create|list|status|switch|retire`
-- (services/indexer/generations/store_pg.py, docs/operations.md "Changing the
-- embedding model"). Every time-dependent statement takes `now` as its last parameter.

-- name: lock_generations
-- The exclusive form of the lock every publish takes in its shared form before it reads the
-- tenant's generations (dual write, services/runtime/indexing/tasks.sql): while `create` adds a
-- tenant's rows and enqueues its backfill (one tenant per transaction), no publish is between reading the rows and
-- committing its tasks, so each document version is either seen by the backfill (it was
-- committed before) or dual-written into the new generation (it reads the new rows). `retire`
-- takes it too, so no publish enqueues into a generation whose rows it is deleting.
-- Transaction-level: released at commit or rollback.
SELECT pg_advisory_xact_lock(hashtextextended('kb.search_generation', 0))

-- name: find_generation
-- FOR SHARE: a switch holds the target's row until it commits, so a concurrent `retire`
-- (whose UPDATE to RETIRING takes it) waits for the switch, or the switch waits for the
-- retire and then reads the new state. Taken after the tenant's rows, as completions do.
SELECT generation_id, provider_profile, embedding_model, dimension, chunk_max_tokens,
       chunk_overlap_tokens, chunking_settings, is_default, state
  FROM search_generation
 WHERE generation_id = $1
   FOR SHARE

-- name: read_generation
-- Without a lock: retire reads it under lock_generations and locks the row last.
SELECT generation_id, provider_profile, embedding_model, dimension, chunk_max_tokens,
       chunk_overlap_tokens, chunking_settings, is_default, state
  FROM search_generation
 WHERE generation_id = $1

-- name: default_generation
SELECT generation_id, provider_profile, embedding_model, dimension, chunk_max_tokens,
       chunk_overlap_tokens, chunking_settings, is_default, state
  FROM search_generation
 WHERE is_default

-- name: live_generations_of_model
-- $1 model: the generations not retired that embed with it (the model's dimension, and
-- whether chunk settings would make two generations' chunks indistinguishable).
SELECT generation_id, provider_profile, embedding_model, dimension, chunk_max_tokens,
       chunk_overlap_tokens, chunking_settings, is_default, state
  FROM search_generation
 WHERE embedding_model = $1
   AND state <> 'RETIRED'
 ORDER BY generation_id

-- name: registered_model_dimension
-- The dimension the indexers registered model $1 with (index_generation: one per model).
SELECT dimension FROM index_generation WHERE embedding_model = $1 LIMIT 1

-- name: insert_generation
-- $1 profile, $2 model, $3 dimension, $4 chunk tokens, $5 overlap, $6 now. Nothing when the
-- same setup is live already (search_generation_setup): the caller then reads that one.
INSERT INTO search_generation (provider_profile, embedding_model, dimension, chunk_max_tokens,
                               chunk_overlap_tokens, created_at)
VALUES ($1, $2, $3, $4, $5, coalesce($6::timestamptz, now()))
ON CONFLICT (provider_profile, embedding_model, dimension, chunk_max_tokens,
             chunk_overlap_tokens) WHERE state <> 'RETIRED' DO NOTHING
RETURNING generation_id

-- name: find_setup
SELECT generation_id, provider_profile, embedding_model, dimension, chunk_max_tokens,
       chunk_overlap_tokens, chunking_settings, is_default, state
  FROM search_generation
 WHERE provider_profile = $1 AND embedding_model = $2 AND dimension = $3
   AND chunk_max_tokens = $4 AND chunk_overlap_tokens = $5
   AND state <> 'RETIRED'

-- name: existing_tenants
-- $1 tenant ids: those that exist.
SELECT tenant_id FROM tenant WHERE tenant_id = ANY ($1::text[]) ORDER BY tenant_id

-- name: all_tenants
SELECT tenant_id FROM tenant ORDER BY tenant_id

-- name: pin_tenants
-- $1 tenants (NULL: every tenant), $2 the default generation, $3 now. A tenant without any
-- row is served by whichever generation is the default; before it is built in another one
-- it gets a row of its own for the current default, serving, so that a later change of the
-- indexers' configuration (a new default) does not move its search under it. Returns the
-- tenants pinned now.
INSERT INTO tenant_search_generation (tenant_id, generation_id, serving, added_at, switched_at)
SELECT t.tenant_id, $2, true, coalesce($3::timestamptz, now()), coalesce($3::timestamptz, now())
  FROM tenant t
 WHERE ($1::text[] IS NULL OR t.tenant_id = ANY ($1::text[]))
   AND NOT EXISTS (SELECT 1 FROM tenant_search_generation x WHERE x.tenant_id = t.tenant_id)
ON CONFLICT (tenant_id, generation_id) DO NOTHING
RETURNING tenant_id

-- name: served_pointers
-- $1 a tenant just pinned, $2 its model, $3 its chunking settings, $4 the last document read
-- (NULL: from the first), $5 how many. What the tenant's documents hold in the default
-- generation: their search pointers of its model and chunk settings (whatever code chunked),
-- a page at a time in document order; recorded by the sink's one upsert
-- (services/indexer/sink/generations.sql: upsert_document_generation_version).
SELECT s.document_id, s.version_number, s.chunking_strategy,
       coalesce(s.chunk_count, 0) AS chunk_count, s.task_id, s.switched_at
  FROM document_search_version s
 WHERE s.tenant_id = $1
   AND s.embedding_model = $2
   AND split_part(s.chunking_strategy, ':code=', 1) = $3
   AND ($4::uuid IS NULL OR s.document_id > $4)
 ORDER BY s.document_id
 LIMIT $5

-- name: add_tenant_rows
-- $1 tenants (NULL: every tenant), $2 the generation, $3 now. Built in it from now on (every
-- publish is indexed into it as well), not serving. Returns the rows added now.
INSERT INTO tenant_search_generation (tenant_id, generation_id, serving, added_at)
SELECT t.tenant_id, $2, false, coalesce($3::timestamptz, now())
  FROM tenant t
 WHERE ($1::text[] IS NULL OR t.tenant_id = ANY ($1::text[]))
ON CONFLICT (tenant_id, generation_id) DO NOTHING
RETURNING tenant_id

-- name: enqueue_backfill
-- $1 tenants (NULL: every tenant), $2 the generation, $3 the attempt budget, $4 now. Tasks
-- (generation $2, priority 1: below the tenant's publishes) for each document that is
-- searchable or published: at its served version and, when a newer one is published, at
-- that one too, each unless the generation holds it (or a newer one) already. The served
-- version is built even when a newer one is on its way: if the newer one never indexes (a
-- corrupt file, DEAD), the generation still holds what search serves today, and a switch is
-- not refused for ever (the chaos run found that, RELIABILITY.md). The generation's record
-- is forward-only, so the newer one wins whichever finishes last. ON CONFLICT DO NOTHING on
-- the business key: running `create` again adds only what is missing. Only tenants built in
-- the generation.
INSERT INTO index_task (task_id, tenant_id, document_id, version_number, task_type, tier,
                        status, max_attempts, next_attempt_at, created_at, updated_at,
                        generation_id, priority)
SELECT gen_random_uuid(), d.tenant_id, d.document_id, w.version_number, 'INDEX_VERSION', t.tier,
       'PENDING', $3::integer, coalesce($4::timestamptz, now()), coalesce($4::timestamptz, now()),
       coalesce($4::timestamptz, now()), $2, 1
  FROM document d
  JOIN tenant t ON t.tenant_id = d.tenant_id
  JOIN tenant_search_generation b
    ON b.tenant_id = d.tenant_id AND b.generation_id = $2
  LEFT JOIN document_search_version s
         ON s.tenant_id = d.tenant_id AND s.document_id = d.document_id
 CROSS JOIN LATERAL (SELECT DISTINCT v.version_number
                       FROM unnest(ARRAY[s.version_number, d.published_version]) AS v (version_number)
                      WHERE v.version_number IS NOT NULL) w
 WHERE ($1::text[] IS NULL OR d.tenant_id = ANY ($1::text[]))
   -- A deleted document is built into no generation (docs/architecture.md#document-
   -- lifecycle); its tombstone would refuse the task's completion anyway.
   AND d.deleted_at IS NULL
   AND NOT EXISTS (SELECT 1
                     FROM document_generation_version g
                    WHERE g.tenant_id = d.tenant_id
                      AND g.document_id = d.document_id
                      AND g.generation_id = $2
                      AND g.version_number >= w.version_number)
ON CONFLICT ON CONSTRAINT index_task_business_key DO NOTHING

-- name: generations_overview
-- Every generation with the tenants it serves and is built in. A tenant without rows is
-- served by (and built in) the default.
SELECT g.generation_id, g.provider_profile, g.embedding_model, g.dimension,
       g.chunk_max_tokens, g.chunk_overlap_tokens, g.chunking_settings, g.is_default, g.state,
       g.created_at, g.retired_at,
       (SELECT count(*) FROM tenant_search_generation x
         WHERE x.generation_id = g.generation_id AND x.serving)
       + CASE WHEN g.is_default
              THEN (SELECT count(*) FROM tenant t
                     WHERE NOT EXISTS (SELECT 1 FROM tenant_search_generation x
                                        WHERE x.tenant_id = t.tenant_id))
              ELSE 0 END AS tenants_serving,
       (SELECT count(*) FROM tenant_search_generation x
         WHERE x.generation_id = g.generation_id)
       + CASE WHEN g.is_default
              THEN (SELECT count(*) FROM tenant t
                     WHERE NOT EXISTS (SELECT 1 FROM tenant_search_generation x
                                        WHERE x.tenant_id = t.tenant_id))
              ELSE 0 END AS tenants_built
  FROM search_generation g
 ORDER BY g.generation_id

-- name: generation_progress
-- $1 tenant (NULL: every tenant). Per generation (not retired): documents done (the
-- generation holds a version at least as new as the one served, or the document has no
-- pointer), pending (its tasks not finished), failed (its DEAD tasks of a version it does not
-- hold yet), and the chunks its rows count. One pass over document_generation_version and
-- the generation's tasks (index_task_generation); what the operator page shows on each
-- refresh, so no scan of knowledge_chunk here (chunks_on_disk does that, for the CLI).
SELECT g.generation_id,
       coalesce(done.documents, 0) AS done,
       coalesce(done.chunks, 0) AS chunks,
       coalesce(tasks.pending, 0) AS pending,
       coalesce(tasks.failed, 0) AS failed
  FROM search_generation g
  LEFT JOIN LATERAL (
        SELECT count(*) FILTER (WHERE s.version_number IS NULL
                                   OR v.version_number >= s.version_number) AS documents,
               sum(v.chunk_count) AS chunks
          FROM document_generation_version v
          LEFT JOIN document_search_version s
                 ON s.tenant_id = v.tenant_id AND s.document_id = v.document_id
         WHERE v.generation_id = g.generation_id
           AND ($1::text IS NULL OR v.tenant_id = $1)) done ON true
  LEFT JOIN LATERAL (
        SELECT count(*) FILTER (WHERE k.status IN ('PENDING', 'RUNNING', 'RETRY_WAIT'))
                   AS pending,
               count(*) FILTER (WHERE k.status = 'DEAD'
                                  AND NOT EXISTS (
                                        SELECT 1 FROM document_generation_version v
                                         WHERE v.tenant_id = k.tenant_id
                                           AND v.document_id = k.document_id
                                           AND v.generation_id = k.generation_id
                                           AND v.version_number >= k.version_number))
                   AS failed
          FROM index_task k
         WHERE k.generation_id = g.generation_id
           AND ($1::text IS NULL OR k.tenant_id = $1)) tasks ON true
 WHERE g.state <> 'RETIRED'
 ORDER BY g.generation_id

-- name: chunks_on_disk
-- $1 model, $2 chunk settings, $3 tenant (NULL: every tenant): the generation's chunks in
-- knowledge_chunk (every version it still holds) and their size. Reads each partition's
-- chunks of the model: for `kb index generations status`, not for a page that refreshes.
SELECT count(*) AS chunks, coalesce(sum(pg_column_size(k.*)), 0)::bigint AS bytes
  FROM knowledge_chunk k
 WHERE k.embedding_model = $1
   AND split_part(k.chunking_strategy, ':code=', 1) = $2
   AND ($3::text IS NULL OR k.tenant_id = $3)

-- name: serving_tenants
-- $1 generation, $2 whether it is the default, $3 tenant (NULL: every tenant), $4 limit.
SELECT t.tenant_id
  FROM tenant t
 WHERE ($3::text IS NULL OR t.tenant_id = $3)
   AND (EXISTS (SELECT 1 FROM tenant_search_generation x
                 WHERE x.tenant_id = t.tenant_id AND x.generation_id = $1 AND x.serving)
        OR ($2::boolean AND NOT EXISTS (SELECT 1 FROM tenant_search_generation x
                                         WHERE x.tenant_id = t.tenant_id)))
 ORDER BY t.tenant_id
 LIMIT $4

-- name: lock_tenant_generations
-- $1 tenant. The switch's lock: every completion of the tenant reads its serving row FOR
-- SHARE in its fenced transaction (services/indexer/sink), so once these are held no
-- completion of the tenant is between deciding where its pointer goes and committing; the
-- ones that committed before are seen by the switch's next statements (READ COMMITTED).
SELECT generation_id, serving
  FROM tenant_search_generation
 WHERE tenant_id = $1
 ORDER BY generation_id
   FOR UPDATE

-- name: all_missing_documents
-- $1 tenant, $2 target generation. The tenant's searchable documents whose served version
-- the target does not hold (no row, or an older version): a switch would make them
-- unsearchable or take them back in time. Read under lock_tenant_generations. A deleted
-- document's tombstone serves nothing and is never rewritten: it is missing from none.
-- missing_documents shows the first of them, count_missing_documents counts them all.
SELECT s.document_id, s.version_number AS served_version, g.version_number AS built_version
  FROM document_search_version s
  LEFT JOIN document_generation_version g
         ON g.tenant_id = s.tenant_id AND g.document_id = s.document_id
        AND g.generation_id = $2
 WHERE s.tenant_id = $1
   AND s.deleted_at IS NULL
   AND (g.version_number IS NULL OR g.version_number < s.version_number)

-- name: missing_documents
-- $1 tenant, $2 target generation, $3 limit: the first of all_missing_documents.
-- include: all_missing_documents
 ORDER BY s.document_id
 LIMIT $3

-- name: count_missing_documents
-- $1 tenant, $2 target generation.
SELECT count(*)
  FROM (
        -- include: all_missing_documents
       ) AS missing

-- name: drop_missing_pointers
-- $1 tenant, $2 target generation (--force): the pointers of the documents the target does
-- not hold go; those documents are not searchable until the target's task completes (its
-- sink then inserts the pointer, at a version not below the document's high-water mark).
-- A tombstone is never dropped (migration 0030's trigger would refuse it): the document
-- stays deleted whatever the target holds. The conditions are on the pointer row itself
-- (not a list of documents read once, as all_missing_documents reads them): a pointer that a
-- concurrent delete tombstones, or a switch moves, while this statement waits for its lock
-- is judged again as it is then (READ COMMITTED re-checks the WHERE on the newer row).
DELETE FROM document_search_version s
 WHERE s.tenant_id = $1
   AND s.deleted_at IS NULL
   AND NOT EXISTS (SELECT 1
                     FROM document_generation_version g
                    WHERE g.tenant_id = s.tenant_id
                      AND g.document_id = s.document_id
                      AND g.generation_id = $2
                      AND g.version_number >= s.version_number)

-- name: rewrite_pointers
-- $1 tenant, $2 target generation, $3 its model, $4 now. Every pointer of the tenant to what
-- the target holds of its document: a version at least as new (never back: the pointer's
-- trigger would refuse), the target's model, strategy and chunk count. Search reads pointer
-- and chunks together, so once this commits every document is served from the target alone.
-- switched_at says since when the version is searchable (publish -> searchable latency, on
-- the operator page and in the metrics): unchanged at the same version, which was searchable
-- before the switch; now for a newer one, which becomes searchable with it.
-- Answers how many pointers it rewrote and the documents whose pointer moved to a newer
-- version (`old`: PostgreSQL 18 RETURNING): those serve that version's ACL from the same
-- commit, which the switch then applies (services/runtime/tenancy/served_acl.sql: apply_served_acl,
-- issue 29 item 1). Only the moved ones travel back: a switch to a generation built at the
-- served versions returns an empty list however large the tenant.
WITH rewritten AS (
    UPDATE document_search_version s
       SET version_number = g.version_number,
           embedding_model = $3,
           chunking_strategy = g.chunking_strategy,
           chunk_count = g.chunk_count,
           task_id = g.task_id,
           switched_at = CASE WHEN g.version_number > s.version_number
                              THEN coalesce($4::timestamptz, now())
                              ELSE s.switched_at END
      FROM document_generation_version g
     WHERE s.tenant_id = $1
       -- A tombstone is left as it is: a deleted document is served by no generation
       -- (migration 0030's trigger refuses any rewrite of it).
       AND s.deleted_at IS NULL
       AND g.tenant_id = s.tenant_id
       AND g.document_id = s.document_id
       AND g.generation_id = $2
       AND g.version_number >= s.version_number
    RETURNING s.document_id, old.version_number < new.version_number AS moved
)
SELECT count(*) AS rewritten,
       coalesce(array_agg(document_id) FILTER (WHERE moved), '{}') AS moved
  FROM rewritten

-- name: serve_documents_only_the_target_holds
-- $1 tenant, $2 target generation, $3 its model, $4 now. After rewrite_pointers: documents
-- the target holds that have no pointer at all -- published, built in the target (dual
-- write), but their serving generation's task has not completed (in flight, or DEAD). Once
-- the tenant is switched such a task completes beside the target and moves no pointer, so
-- without this the document would stay unsearchable until its next publish. Never below the
-- document's high-water mark (a pointer a --force switch just dropped stays dropped until
-- the target holds that version). Under lock_tenant_generations no completion of the
-- tenant runs meanwhile, so no pointer can be inserted concurrently. Answers the documents
-- given a pointer: their served ACL is set from the version's by the switch, as a first
-- switch of the sink does.
WITH served AS (
    INSERT INTO document_search_version (tenant_id, document_id, version_number,
                                         embedding_model, chunking_strategy, chunk_count,
                                         task_id, switched_at)
    SELECT g.tenant_id, g.document_id, g.version_number, $3, g.chunking_strategy,
           g.chunk_count, g.task_id, coalesce($4::timestamptz, now())
      FROM document_generation_version g
     WHERE g.tenant_id = $1
       AND g.generation_id = $2
       AND NOT EXISTS (SELECT 1
                         FROM document_search_version s
                        WHERE s.tenant_id = g.tenant_id AND s.document_id = g.document_id)
       AND NOT EXISTS (SELECT 1
                         FROM document_search_version_high_water h
                        WHERE h.tenant_id = g.tenant_id
                          AND h.document_id = g.document_id
                          AND h.version_number > g.version_number)
    ON CONFLICT (tenant_id, document_id) DO NOTHING
    RETURNING document_id
)
SELECT coalesce(array_agg(document_id), '{}') AS served
  FROM served

-- name: stop_serving
-- Two statements, not one: tenant_search_generation_serving is checked row by row, so the
-- old serving row must be cleared before the new one is set.
UPDATE tenant_search_generation
   SET serving = false
 WHERE tenant_id = $1 AND serving

-- name: start_serving
UPDATE tenant_search_generation
   SET serving = true, switched_at = coalesce($3::timestamptz, now())
 WHERE tenant_id = $1 AND generation_id = $2

-- name: tenant_exists
SELECT EXISTS (SELECT 1 FROM tenant WHERE tenant_id = $1)

-- name: lock_unfinished_tasks
-- $1 generation. Its tasks not finished, locked (retire), in the one lock order of task
-- rows: (tenant_id in byte order, document_id, version_number, task_id), before any tenant
-- row, as a completion locks them (queue/queries.sql: complete_task). A completion holding
-- one of them is waited for: it commits (the task is SUCCEEDED, left out once the lock is
-- ours) or rolls back; either way no tenant row of ours is in its way.
-- How many: the ids stay in the database.
SELECT count(*)
  FROM (SELECT task_id
          FROM index_task
         WHERE generation_id = $1
           AND status IN ('PENDING', 'RUNNING', 'RETRY_WAIT')
         ORDER BY tenant_id COLLATE "C", document_id, version_number, task_id
           FOR UPDATE) AS locked

-- name: serving_rows_of_generation
-- $1 generation: its tenant rows, locked (retire) after its task rows (lock_unfinished_tasks)
-- and in tenant order (byte order, the order a completion group takes its tenants in): a
-- switch to it holds them FOR UPDATE until it commits, so a tenant that starts serving it
-- meanwhile is seen here.
SELECT tenant_id, serving
  FROM tenant_search_generation
 WHERE generation_id = $1
 ORDER BY tenant_id COLLATE "C"
   FOR UPDATE

-- name: start_retiring
-- Takes the generation's row lock: a completion of one of its tasks holding it FOR SHARE
-- (sink: lock_completion_generation) committed before end_unfinished_tasks got its task
-- row, so none is left to wait for.
UPDATE search_generation
   SET state = 'RETIRING'
 WHERE generation_id = $1 AND state = 'ACTIVE'

-- name: delete_tenant_rows
-- The generation's tenant rows: publishes stop indexing into it (they read the rows under
-- the shared form of lock_generations).
DELETE FROM tenant_search_generation WHERE generation_id = $1 AND NOT serving

-- name: end_unfinished_tasks
-- $1 generation, $2 error code, $3 message, $4 now. Its tasks not finished end DEAD: no
-- worker claims them any more, and a running one's completion is fenced out (its task is no
-- longer RUNNING under its lease). Their rows are locked already (lock_unfinished_tasks).
UPDATE index_task
   SET status = 'DEAD',
       error_code = $2,
       error_message = $3,
       lease_owner = NULL,
       lease_until = NULL,
       finished_at = coalesce($4::timestamptz, now()),
       updated_at = coalesce($4::timestamptz, now())
 WHERE generation_id = $1
   AND status IN ('PENDING', 'RUNNING', 'RETRY_WAIT')

-- name: generation_chunk_settings
-- $1 generation: the chunk settings its rows were built with, when the generation has none
-- recorded (no indexer recorded them).
SELECT DISTINCT split_part(chunking_strategy, ':code=', 1) AS settings
  FROM document_generation_version
 WHERE generation_id = $1

-- name: shared_chunk_settings
-- $1 generation, $2 model, $3 chunk settings: another generation not retired whose chunks
-- are the same rows (same model and chunk settings): they are then not deleted.
SELECT EXISTS (SELECT 1 FROM search_generation
                WHERE generation_id <> $1 AND state <> 'RETIRED'
                  AND embedding_model = $2 AND chunking_settings = $3)

-- name: tenants_with_chunks
SELECT tenant_id FROM tenant ORDER BY tenant_id

-- name: delete_chunk_batch
-- $1 tenant, $2 model, $3 chunk settings, $4 batch size. At most $4 of the retired
-- generation's chunks of one tenant (partition pruned by the tenant, then the reuse index's
-- (tenant, model) prefix), in a transaction of its own so the lock and WAL of one statement
-- stay small. A chunk a search pointer names is never deleted (a pointer no switch rewrote:
-- written by hand, say). ``removed``: the rows it deleted; ``seen``: the rows its snapshot
-- held for it. A batch whose rows another session (a second retire, the collector, a
-- document erase) deleted while it waited on their locks removes none though more are
-- left, so the loop ends only with a batch that saw nothing.
WITH doomed AS (
    SELECT k.tenant_id, k.document_id, k.version_number, k.embedding_model, k.chunk_id
      FROM knowledge_chunk k
     WHERE k.tenant_id = $1
       AND k.embedding_model = $2
       AND split_part(k.chunking_strategy, ':code=', 1) = $3
       AND NOT EXISTS (SELECT 1
                         FROM document_search_version s
                        WHERE s.tenant_id = k.tenant_id
                          AND s.document_id = k.document_id
                          AND s.version_number = k.version_number
                          AND s.embedding_model = k.embedding_model
                          AND s.chunking_strategy = k.chunking_strategy)
     LIMIT $4
), gone AS (
    DELETE FROM knowledge_chunk k
     USING doomed d
     WHERE (k.tenant_id, k.document_id, k.version_number, k.embedding_model, k.chunk_id)
           = (d.tenant_id, d.document_id, d.version_number, d.embedding_model, d.chunk_id)
    RETURNING 1
)
SELECT (SELECT count(*) FROM gone) AS removed, (SELECT count(*) FROM doomed) AS seen

-- name: delete_document_versions_batch
-- $1 generation, $2 batch size (document_generation_version_generation finds them).
-- ``removed`` and ``seen`` as delete_chunk_batch's: a second retire takes the same rows.
WITH doomed AS (
    SELECT ctid FROM document_generation_version WHERE generation_id = $1 LIMIT $2
), gone AS (
    DELETE FROM document_generation_version
     WHERE ctid IN (SELECT ctid FROM doomed)
    RETURNING 1
)
SELECT (SELECT count(*) FROM gone) AS removed, (SELECT count(*) FROM doomed) AS seen

-- name: delete_task_batch
-- $1 generation, $2 batch size. Its tasks, finished by now (end_unfinished_tasks), with their
-- requeue history: the queue does not keep the work of a generation that is gone.
-- ``removed`` and ``seen`` as delete_chunk_batch's: a second retire takes the same rows.
WITH doomed AS (
    SELECT task_id FROM index_task WHERE generation_id = $1 LIMIT $2
), history AS (
    DELETE FROM index_task_requeue r USING doomed d WHERE r.task_id = d.task_id
), gone AS (
    DELETE FROM index_task k USING doomed d WHERE k.task_id = d.task_id RETURNING 1
)
SELECT (SELECT count(*) FROM gone) AS removed, (SELECT count(*) FROM doomed) AS seen

-- name: model_still_used
-- $1 generation, $2 model: another generation not retired embeds with it, or a search
-- pointer names it. Then its ANN index stays. (A full pass over the pointers: once per
-- retire.)
SELECT EXISTS (SELECT 1 FROM search_generation
                WHERE generation_id <> $1 AND state <> 'RETIRED' AND embedding_model = $2)
    OR EXISTS (SELECT 1 FROM document_search_version WHERE embedding_model = $2)

-- name: model_indexes
-- $1 the model's ANN index name: it and the tenant graphs named after it.
SELECT c.relname AS index_name, c.relkind = 'I' AS partitioned
  FROM pg_class c
 WHERE c.relkind IN ('i', 'I')
   AND (c.relname = $1 OR c.relname LIKE $1 || '\_t%')
   AND c.relnamespace = (SELECT relnamespace FROM pg_class WHERE oid = 'knowledge_chunk'::regclass)
 ORDER BY c.relkind = 'I', c.relname

-- name: finish_retiring
UPDATE search_generation
   SET state = 'RETIRED', retired_at = coalesce($2::timestamptz, now())
 WHERE generation_id = $1 AND state = 'RETIRING'
