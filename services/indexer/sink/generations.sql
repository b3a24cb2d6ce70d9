-- Search generations as the indexer sees them (services/indexer/sink/generations.py,
-- migration 0022): the registration of the default at indexer start, the resolution of a
-- task's generation, and the bookkeeping of each completion in its fenced transaction.

-- name: lock_search_generations
-- Exclusive and transaction-level: the key publishes take in shared mode before they read a
-- tenant's generations (services/runtime/indexing/tasks.sql) and `kb index generations create` takes
-- exclusively. Concurrent indexer starts register the default one at a time.
SELECT pg_advisory_xact_lock(hashtextextended('kb.search_generation', 0))

-- name: find_live_search_generation
-- $1 profile, $2 model, $3 dimension, $4 chunk tokens, $5 overlap: the live generation of
-- this setup (search_generation_setup: at most one that is not RETIRED).
SELECT *
  FROM search_generation
 WHERE provider_profile = $1
   AND embedding_model = $2
   AND dimension = $3
   AND chunk_max_tokens = $4
   AND chunk_overlap_tokens = $5
   AND state <> 'RETIRED'

-- name: default_search_generation
-- The default as it is before this start registers its own (default_change.py).
SELECT * FROM search_generation WHERE is_default

-- name: tenants_searching_the_default
-- $1 how many to name. The tenants without a generation of their own (no
-- tenant_search_generation row: the default serves them) that have a search pointer, in
-- tenant order, each with the count of them all (default_change.py). One probe of each
-- table's tenant_id-led key per tenant.
SELECT t.tenant_id, count(*) OVER () AS total
  FROM tenant t
 WHERE NOT EXISTS (SELECT 1 FROM tenant_search_generation g WHERE g.tenant_id = t.tenant_id)
   AND EXISTS (SELECT 1 FROM document_search_version p WHERE p.tenant_id = t.tenant_id)
 ORDER BY t.tenant_id
 LIMIT $1

-- name: insert_search_generation
-- $1 profile, $2 model, $3 dimension, $4 chunk tokens, $5 overlap, $6 now. Not the default
-- yet: make_default_search_generation makes it so once the old default has let go (the
-- one-default unique index is checked row by row).
INSERT INTO search_generation (provider_profile, embedding_model, dimension, chunk_max_tokens,
                               chunk_overlap_tokens, created_at)
VALUES ($1, $2, $3, $4, $5, coalesce($6::timestamptz, now()))
RETURNING *

-- name: clear_other_defaults
-- $1 the generation to become the default.
UPDATE search_generation SET is_default = false WHERE is_default AND generation_id <> $1

-- name: make_default_search_generation
-- $1 generation, $2 its chunking settings (the strategy id without the code digest): made
-- the default, its settings recorded when not yet known, never rewritten (they name its
-- chunks). The row as it now is; written only when something changes, so that a restart
-- neither waits for completions holding it FOR SHARE (lock_completion_generation) nor
-- leaves a dead row version behind.
WITH changed AS (
    UPDATE search_generation
       SET is_default = true,
           chunking_settings = coalesce(chunking_settings, $2::text)
     WHERE generation_id = $1
       AND (NOT is_default OR chunking_settings IS NULL)
    RETURNING *
)
SELECT * FROM changed
UNION ALL
SELECT * FROM search_generation
 WHERE generation_id = $1 AND NOT EXISTS (SELECT 1 FROM changed)

-- name: record_chunking_settings
-- $1 generation, $2 its chunking settings, as the first indexer that builds it chunks; the
-- row as it now is (written only when they were not known, as above).
WITH changed AS (
    UPDATE search_generation
       SET chunking_settings = $2::text
     WHERE generation_id = $1
       AND chunking_settings IS NULL
    RETURNING *
)
SELECT * FROM changed
UNION ALL
SELECT * FROM search_generation
 WHERE generation_id = $1 AND NOT EXISTS (SELECT 1 FROM changed)

-- name: task_search_generations
-- $1 tenants, $2 the tasks' generations (NULL: the tenant's serving one), one element per
-- task, for the tasks of several slots at once (services/runtime/pg/coalesce.py). The
-- generation a task builds: its own, else the tenant's serving row's, else the default (a
-- tenant without rows); each row with what it was asked for (asked_tenant_id,
-- asked_generation_id). No row for a pair: none of them exists (no indexer registered a
-- default yet). Read without a lock: the completion checks again under
-- lock_completion_generation.
SELECT k.tenant_id AS asked_tenant_id, k.generation_id AS asked_generation_id, g.*
  FROM unnest($1::text[], $2::integer[]) AS k (tenant_id, generation_id)
  JOIN search_generation g
    ON g.generation_id = coalesce(
           k.generation_id,
           (SELECT t.generation_id
              FROM tenant_search_generation t
             WHERE t.tenant_id = k.tenant_id AND t.serving),
           (SELECT d.generation_id FROM search_generation d WHERE d.is_default))

-- name: lock_completion_generation
-- $1 tenants, $2 the generations the tasks built, $3 whether each task named it
-- (generation_id set): one element per distinct (tenant, generation, named) of the
-- completions written (one for a write of its own; a group's in tenant order, the order
-- every group takes the rows in); one row back per element, in order, with its key. The
-- first statement of a completion's write, before the search pointer's lock:
--   * serving: the tenant's serving generation, its row locked FOR SHARE until commit. `kb
--     index generations switch` locks the tenant's rows FOR UPDATE, so a switch and a
--     completion of the tenant never interleave: the completion moves the pointer only
--     for the generation that still serves when it commits, and the switch rewrites the
--     pointers with every completion before it counted. Taken before the pointer's row
--     lock, the order the switch takes them in (its rows, then the pointers): no deadlock.
--     A tenant without rows is served by the default (nothing to lock: `create` pins the
--     tenant -- adds its rows -- under the exclusive advisory lock before any switch, and
--     the pinned default still serves then).
--   * state: the named generation's state, its row locked FOR SHARE, so `kb index
--     generations retire` (which sets RETIRING first) cannot start deleting its rows while
--     this completion adds some. NULL when the task did not name it ($3 false: the serving
--     generation, which retire refuses to touch): every publish's completion would
--     otherwise lock the default's one row.
--     Every row of the tenant is locked, and which one serves is read from the locked
--     rows: a completion that waited for a switch gets the rows as the switch left them.
--     `WHERE t.serving ... FOR SHARE` would not: after the wait, READ COMMITTED re-checks
--     only the row the statement had found (no longer serving) and never sees the new
--     serving row, so the completion took the default for the serving generation and a
--     task of the new one moved no pointer (found by `kb chaos run`).
SELECT k.tenant_id, k.generation_id, k.named,
       coalesce(
           (SELECT max(t.generation_id) FILTER (WHERE t.serving)
              FROM (SELECT generation_id, serving
                      FROM tenant_search_generation
                     WHERE tenant_id = k.tenant_id
                     ORDER BY generation_id
                       FOR SHARE) t),
           (SELECT d.generation_id FROM search_generation d WHERE d.is_default))
           AS serving,
       (SELECT g.state
          FROM search_generation g
         WHERE g.generation_id = k.generation_id AND k.named
           FOR SHARE) AS state
  FROM unnest($1::text[], $2::integer[], $3::boolean[]) WITH ORDINALITY
       AS k (tenant_id, generation_id, named, n)
 ORDER BY k.n

-- name: upsert_document_generation_version
-- What a generation holds of a document: the one statement that writes it, for both its
-- writers. $1 tenants, $2 documents, $3 versions, $4 strategies, $5 chunk counts,
-- $6 generations, $7 tasks, one element per document and generation, in (tenant, document)
-- order: the order every group locks them in; $8 now; $9 when each was built (NULL: now);
-- $10 whether the writer built the version (true) or copies a served pointer (false).
-- Forward only, as the pointer: an older version finishing late leaves the row alone (the
-- WHERE). The same version differs by writer (tests/integration/test_generation_record.py):
-- - a fenced completion (record_versions, several for a group written together, together.py)
--   built it: a re-run replaced the version's chunk set, so the row is rewritten. The switch
--   reads the row (is the served version complete in the target?) and rewrites the pointers
--   from it. Concurrent completions of the document in the generation serialise on the row
--   (ON CONFLICT locks it; a first insert waits on the unique index);
-- - `kb index generations create` copies a pinned tenant's served pointers into the default
--   generation (services/indexer/generations/store_pg.py): a pointer only mirrors what a
--   completion recorded, so a row at the pointer's version stays as the completion wrote it.
INSERT INTO document_generation_version AS d (tenant_id, document_id, version_number,
                                              chunking_strategy, chunk_count, generation_id,
                                              task_id, built_at)
SELECT w.tenant_id, w.document_id, w.version_number, w.chunking_strategy, w.chunk_count,
       w.generation_id, w.task_id, coalesce(w.built_at, $8::timestamptz, now())
  FROM unnest($1::text[], $2::uuid[], $3::integer[], $4::text[], $5::integer[],
              $6::integer[], $7::uuid[], $9::timestamptz[])
       WITH ORDINALITY AS w (tenant_id, document_id, version_number, chunking_strategy,
                             chunk_count, generation_id, task_id, built_at, n)
 ORDER BY w.n
ON CONFLICT (tenant_id, document_id, generation_id) DO UPDATE
   SET version_number = EXCLUDED.version_number,
       chunking_strategy = EXCLUDED.chunking_strategy,
       chunk_count = EXCLUDED.chunk_count,
       task_id = EXCLUDED.task_id,
       built_at = EXCLUDED.built_at
 WHERE d.version_number < EXCLUDED.version_number
    OR (d.version_number = EXCLUDED.version_number AND $10::boolean)

-- name: discard_task_stream
-- $1 task. A streamed task whose generation was retired while it ran: its staged slices
-- (every attempt's) go with its completion, which writes nothing else.
DELETE FROM knowledge_chunk_stream WHERE task_id = $1
