-- `kb index check` (services/indexer/index_check_pg.py).

-- name: document_index_states
-- $1 tenant (NULL: every tenant). One statement, one snapshot: the pointer, the chunks it
-- names and the tasks are read as of the same instant, so a switch committing meanwhile is
-- seen whole or not at all (never "pointer moved, chunks not yet there").
-- The chunk count is one primary-key range scan per served document.
SELECT d.tenant_id, t.tier, d.document_id, d.published_version,
       s.version_number AS served_version, s.chunk_count AS recorded_chunks,
       present.chunks AS present_chunks,
       pt.task_id AS published_task_id, pt.status AS published_task_status,
       st.task_id AS served_task_id, st.status AS served_task_status
  FROM document d
  JOIN tenant t ON t.tenant_id = d.tenant_id
  LEFT JOIN document_search_version s
         ON s.tenant_id = d.tenant_id AND s.document_id = d.document_id
  LEFT JOIN index_task pt
         ON pt.tenant_id = d.tenant_id AND pt.document_id = d.document_id
        AND pt.version_number = d.published_version AND pt.task_type = $2
  LEFT JOIN index_task st
         ON st.tenant_id = d.tenant_id AND st.document_id = d.document_id
        AND st.version_number = s.version_number AND st.task_type = $2
  LEFT JOIN LATERAL (
        SELECT count(*)::integer AS chunks
          FROM knowledge_chunk c
         WHERE c.tenant_id = s.tenant_id
           AND c.document_id = s.document_id
           AND c.version_number = s.version_number
           AND c.embedding_model = s.embedding_model
           AND c.chunking_strategy IS NOT DISTINCT FROM s.chunking_strategy
       ) present ON s.document_id IS NOT NULL
 WHERE ($1::text IS NULL OR d.tenant_id = $1)
   AND (d.published_version IS NOT NULL OR s.document_id IS NOT NULL)
 ORDER BY d.tenant_id, d.document_id

-- name: tenant_exists
SELECT EXISTS (SELECT 1 FROM tenant WHERE tenant_id = $1)

-- name: rerun_succeeded_task
-- $1 task, $2 who, $3 attempt budget, $4 now. Only a task still SUCCEEDED (the row lock
-- makes a concurrent repair of the same task a no-op: it finds PENDING after the wait).
-- `attempts` is kept, as by `kb tasks requeue`: it is the fencing generation and must never
-- repeat. The repair is recorded beside the operators' requeues.
WITH target AS (
    SELECT task_id, attempts, max_attempts
      FROM index_task
     WHERE task_id = $1 AND status = 'SUCCEEDED'
       FOR UPDATE
),
rerun AS (
    UPDATE index_task t
       SET status = 'PENDING',
           max_attempts = g.attempts + $3::integer,
           lease_owner = NULL,
           lease_until = NULL,
           next_attempt_at = coalesce($4::timestamptz, now()),
           error_code = NULL,
           error_message = NULL,
           updated_at = coalesce($4::timestamptz, now()),
           finished_at = NULL
      FROM target g
     WHERE t.task_id = g.task_id
    RETURNING t.task_id, t.max_attempts
)
INSERT INTO index_task_requeue (task_id, requeued_by, requeued_at, reset_attempts, attempts,
                                previous_max_attempts, new_max_attempts, previous_error_code,
                                previous_error_message)
SELECT g.task_id, $2, coalesce($4::timestamptz, now()), true, g.attempts,
       g.max_attempts, r.max_attempts, 'INDEX_DRIFT', 're-run by kb index check --repair'
  FROM target g
  JOIN rerun r ON r.task_id = g.task_id
RETURNING task_id
