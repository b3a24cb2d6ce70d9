-- name: insert_index_task
-- The business key (tenant, document, version, type) is unique: a second enqueue of the same
-- version inserts nothing (it waits for a concurrent insert of the key to commit or roll
-- back first) and find_index_task returns the first task's id.
INSERT INTO index_task (task_id, tenant_id, document_id, version_number, task_type, tier,
                        status, max_attempts, next_attempt_at, created_at, updated_at)
VALUES ($1, $2, $3, $4, $5, $6, 'PENDING', $7::integer,
        coalesce($8::timestamptz, now()), coalesce($8::timestamptz, now()),
        coalesce($8::timestamptz, now()))
ON CONFLICT ON CONSTRAINT index_task_business_key DO NOTHING
RETURNING task_id

-- name: find_index_task
SELECT task_id
  FROM index_task
 WHERE tenant_id = $1
   AND document_id = $2
   AND version_number = $3
   AND task_type = $4
