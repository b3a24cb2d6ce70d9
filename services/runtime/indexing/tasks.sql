-- name: insert_index_task
-- The business key (tenant, document, version, type, generation) is unique: a second enqueue
-- of the same version inserts nothing (it waits for a concurrent insert of the key to commit
-- or roll back first) and find_index_task returns the first task's id. The task builds the
-- tenant's serving generation (generation_id NULL: resolved when it is indexed), at the
-- priority of a publish (0). $9: the publish's W3C traceparent (migration 0034), which
-- every attempt at the task continues.
INSERT INTO index_task (task_id, tenant_id, document_id, version_number, task_type, tier,
                        status, max_attempts, next_attempt_at, created_at, updated_at,
                        traceparent)
VALUES ($1, $2, $3, $4, $5, $6, 'PENDING', $7::integer,
        coalesce($8::timestamptz, now()), coalesce($8::timestamptz, now()),
        coalesce($8::timestamptz, now()), $9::text)
ON CONFLICT ON CONSTRAINT index_task_business_key DO NOTHING
RETURNING task_id

-- name: find_index_task
SELECT task_id
  FROM index_task
 WHERE tenant_id = $1
   AND document_id = $2
   AND version_number = $3
   AND task_type = $4
   AND generation_id IS NULL

-- name: lock_search_generations_shared
-- Taken by every publish before it reads the tenant's generations (insert_generation_tasks);
-- `kb index generations create` takes the exclusive form before it adds a tenant's rows and
-- enqueues its backfill, in the same transaction. So a publish either sees the new
-- generation (and enqueues its task) or commits before the backfill reads the documents
-- (and the backfill enqueues the version it published): never neither. Shared: publishes do
-- not wait for each other. Transaction-level: released at commit or rollback.
SELECT pg_advisory_xact_lock_shared(hashtextextended('kb.search_generation', 0))

-- name: insert_generation_tasks
-- $1 tenant, $2 tier, $3 document ids, $4 their versions, $5 task type, $6 max attempts,
-- $7 now, $8 the publish's traceparents (one per document; migration 0034). The dual write of a publish: one task per (document version, generation the
-- tenant is built in beside its serving one), generation_id set, at a publish's priority
-- (0), so a generation being built never falls behind what the serving one will serve.
-- Only ACTIVE generations: a retiring one is losing its rows. Run under
-- lock_search_generations_shared. DO NOTHING: a task of the key exists (a backfill of this
-- version, a retried publish); it keeps its priority. Ordered so that concurrent bulk
-- publishes of one tenant insert keys in one order (they never share a key anyway: new
-- documents).
INSERT INTO index_task (task_id, tenant_id, document_id, version_number, task_type, tier,
                        status, max_attempts, next_attempt_at, created_at, updated_at,
                        generation_id, priority, traceparent)
SELECT gen_random_uuid(), $1, d.document_id, d.version_number, $5, $2, 'PENDING',
       $6::integer, coalesce($7::timestamptz, now()), coalesce($7::timestamptz, now()),
       coalesce($7::timestamptz, now()), g.generation_id, 0, d.traceparent
  FROM tenant_search_generation g
  JOIN search_generation s ON s.generation_id = g.generation_id
 CROSS JOIN unnest($3::uuid[], $4::integer[], $8::text[])
            AS d (document_id, version_number, traceparent)
 WHERE g.tenant_id = $1
   AND NOT g.serving
   AND s.state = 'ACTIVE'
 ORDER BY d.document_id, d.version_number, g.generation_id
ON CONFLICT ON CONSTRAINT index_task_business_key DO NOTHING
RETURNING task_id, generation_id
