-- The chaos run's checks read the database with these (kbtools/chaos/checks/), as the
-- services read theirs: named queries, loaded once (services/runtime/pg/sql.py).

-- name: pointers
-- Each document's served version beside the newest version whose task succeeded in the
-- pointer's own generation (newest; a task of no named generation builds the served one)
-- and in any generation (newest_any); a deleted document is served by its tombstone, not by
-- a version (the checks of deletes judge it: kbtools/chaos/checks/removals.py). A
-- generation is its model and chunk settings, as its chunks say: a pointer's settings are
-- its strategy id without the code digest (chunking_settings in services/index/
-- generation.py); two generations of one model differ in them, and a version one of them
-- built is no version the other's pointer should be at. Hash joins and one aggregate:
-- polled every half second while the run converges, over thousands of documents in the
-- long run.
WITH succeeded AS (
    SELECT t.tenant_id, t.document_id, t.generation_id, g.embedding_model,
           g.chunking_settings, max(t.version_number) AS newest
      FROM index_task t
      LEFT JOIN search_generation g ON g.generation_id = t.generation_id
     WHERE t.status = 'SUCCEEDED'
     GROUP BY 1, 2, 3, 4, 5)
SELECT d.tenant_id, d.document_id, d.deleted_at IS NOT NULL AS deleted,
       s.version_number AS served, s.embedding_model,
       max(x.newest) FILTER (
           WHERE x.generation_id IS NULL
              OR (x.embedding_model = s.embedding_model
                  AND x.chunking_settings = split_part(s.chunking_strategy, ':code=', 1))
       ) AS newest,
       max(x.newest) AS newest_any
  FROM document d
  LEFT JOIN document_search_version s
    ON s.tenant_id = d.tenant_id AND s.document_id = d.document_id
  LEFT JOIN succeeded x
    ON x.tenant_id = d.tenant_id AND x.document_id = d.document_id
 GROUP BY d.tenant_id, d.document_id, d.deleted_at, s.version_number, s.embedding_model,
          s.chunking_strategy

-- name: not_current
-- Live documents not served at their newest indexed version (pointers).
SELECT count(*) FROM (
    -- include: pointers
) p
 WHERE NOT p.deleted
   AND ((p.served IS NULL AND p.newest_any IS NOT NULL)
        OR (p.newest IS NOT NULL AND p.served <> p.newest))

-- name: live_tasks
-- $1 created by (NULL: any). Tasks left to run.
SELECT count(*) FROM index_task
 WHERE status IN ('PENDING', 'RUNNING', 'RETRY_WAIT')
   AND ($1::timestamptz IS NULL OR created_at <= $1)

-- name: wal_position
SELECT pg_current_wal_lsn()::text

-- name: replication_state
-- $1 the replica's application_name.
SELECT state FROM pg_stat_replication WHERE application_name = $1

-- name: replay_behind
-- $1 a WAL position of the primary: bytes the replica has not replayed of it.
SELECT pg_wal_lsn_diff($1::text::pg_lsn, pg_last_wal_replay_lsn())

-- name: ingest_commands
SELECT tenant_id, command_id::text, command_type, document_id::text, version_number
  FROM ingest_command

-- name: ingest_versions
-- Every version of a document a command published: each must be some command's, once.
SELECT v.tenant_id, v.document_id::text, v.version_number
  FROM document_version v
 WHERE (v.tenant_id, v.document_id) IN (
       SELECT tenant_id, document_id FROM ingest_command WHERE document_id IS NOT NULL)

-- name: removal_states
-- What each document holds after the deletes and erases (removals.check_final).
SELECT d.tenant_id, d.document_id::text, d.deleted_at IS NOT NULL AS deleted,
       s.deleted_at IS NOT NULL AS tombstone, e.requested_at IS NOT NULL AS erasing,
       e.erased_at IS NOT NULL AS erased,
       (SELECT count(*) FROM knowledge_chunk c
         WHERE c.tenant_id = d.tenant_id AND c.document_id = d.document_id) AS chunks,
       (SELECT count(*) FROM document_version v
         WHERE v.tenant_id = d.tenant_id AND v.document_id = d.document_id
           AND octet_length(v.content) > 0) AS with_bytes
  FROM document d
  LEFT JOIN document_search_version s
    ON s.tenant_id = d.tenant_id AND s.document_id = d.document_id
  LEFT JOIN document_erasure e
    ON e.tenant_id = d.tenant_id AND e.document_id = d.document_id

-- name: cancelled_live_documents
-- Live documents with tasks cancelled as if they had been deleted.
SELECT t.tenant_id, t.document_id::text, count(*) AS tasks
  FROM index_task t
  JOIN document d ON d.tenant_id = t.tenant_id AND d.document_id = t.document_id
 WHERE t.error_code = 'DOCUMENT_DELETED' AND d.deleted_at IS NULL
 GROUP BY 1, 2

-- name: rerun_candidates
-- Served versions with chunks whose task succeeded, in a stable order to sample from.
SELECT s.tenant_id, s.document_id::text, s.version_number, s.embedding_model,
       s.task_id::text
  FROM document_search_version s
  JOIN index_task t ON t.task_id = s.task_id AND t.status = 'SUCCEEDED'
 WHERE s.chunk_count > 0
 ORDER BY s.tenant_id, s.document_id

-- name: version_chunk_set
-- $1 tenant, $2 document, $3 version, $4 model.
SELECT chunk_id, ordinal, md5(text) FROM knowledge_chunk
 WHERE tenant_id = $1 AND document_id = $2::uuid AND version_number = $3
   AND embedding_model = $4

-- name: damage_version
-- $1 tenant, $2 document, $3 version, $4 model. Its last chunk deleted: the drift that makes
-- `kb index check --repair` re-run its task.
DELETE FROM knowledge_chunk
 WHERE tenant_id = $1 AND document_id = $2::uuid AND version_number = $3
   AND embedding_model = $4
   AND ordinal = (SELECT max(ordinal) FROM knowledge_chunk
                   WHERE tenant_id = $1 AND document_id = $2::uuid
                     AND version_number = $3 AND embedding_model = $4)

-- name: drift_reruns
-- $1 tenant, $2 document, $3 version. Re-runs of any of its tasks for drift.
SELECT count(*) FROM index_task_requeue r
  JOIN index_task t ON t.task_id = r.task_id
 WHERE t.tenant_id = $1 AND t.document_id = $2::uuid AND t.version_number = $3
   AND r.previous_error_code = 'INDEX_DRIFT'

-- name: outbox_events
SELECT event_id::text, aggregate_key, position FROM outbox

-- name: tasks
SELECT task_id, status, error_code, attempts, tenant_id, document_id, version_number
  FROM index_task

-- name: duplicate_chunks
SELECT tenant_id, document_id, version_number, embedding_model, ordinal, count(*)
  FROM knowledge_chunk
 GROUP BY 1, 2, 3, 4, 5
HAVING count(*) > 1

-- name: served_chunk_counts
-- Each served version's chunk count as switched to, beside the chunks stored.
SELECT s.tenant_id, s.document_id, s.version_number, s.chunk_count,
       (SELECT count(*) FROM knowledge_chunk c
         WHERE c.tenant_id = s.tenant_id AND c.document_id = s.document_id
           AND c.version_number = s.version_number
           AND c.embedding_model = s.embedding_model) AS stored
  FROM document_search_version s
 WHERE s.deleted_at IS NULL

-- name: task_versions
SELECT task_id, status, document_id::text, version_number FROM index_task

-- name: served_tasks
-- A tombstone has no task.
SELECT tenant_id, document_id::text, version_number, task_id::text
  FROM document_search_version
 WHERE deleted_at IS NULL

-- name: document_owners
SELECT tenant_id, document_id FROM document

-- name: version_readers
SELECT document_id::text, version_number, principal FROM document_version_acl

-- name: generation_models
SELECT generation_id, embedding_model, is_default FROM search_generation

-- name: answered_chunks
-- $1 the documents the search answers hold.
SELECT document_id::text, version_number, embedding_model, chunk_id, md5(text)
  FROM knowledge_chunk
 WHERE document_id = ANY($1::uuid[])
