-- The retention of superseded versions' content (services/indexer/gc/retention.py,
-- migration 0032, docs/architecture.md#document-lifecycle). One batch is one transaction:
-- take_retention_due, hold_finished_tasks, delete_retained_chunks, then remove_retained_content.

-- name: take_retention_due
-- $1 retention days, $2 most versions, $3 now (NULL: the database's clock). The versions
-- whose content is due: superseded (a newer version is published: they can never be
-- published or served again) at least $1 days before now, content still there, and none of:
-- the version the search pointer names (it serves it while the newer one indexes), a
-- version a generation holds (document_generation_version: what a switch to it would
-- serve; a backfill reads only the pointer's and the published version), a version with an
-- unfinished task (it is about to be read), a document being or having been erased (the
-- erase owns its content). The published version is above every superseded one, so it is
-- never taken.
-- Locking: the version rows FOR NO KEY UPDATE SKIP LOCKED. Collectors in several indexer
-- processes never take the same version and never wait for each other; an erase batch
-- holding a version is skipped, not waited for. NO KEY: a completion's chunk inserts take
-- FOR KEY SHARE on their version (the foreign key), which this mode does not block. A
-- publish's trigger (migration 0032) updates only versions with superseded_at NULL, which
-- are never here: a publish never waits for this either.
SELECT v.tenant_id, v.document_id, v.version_number
  FROM document_version v
  JOIN document d ON d.tenant_id = v.tenant_id AND d.document_id = v.document_id
 WHERE v.superseded_at IS NOT NULL
   AND v.content_removed_at IS NULL
   AND v.superseded_at <= coalesce($3::timestamptz, now()) - make_interval(days => $1::integer)
   AND v.version_number < d.published_version
   AND NOT EXISTS (SELECT 1 FROM document_search_version s
                    WHERE s.tenant_id = v.tenant_id AND s.document_id = v.document_id
                      AND s.version_number = v.version_number)
   AND NOT EXISTS (SELECT 1 FROM document_generation_version g
                    WHERE g.tenant_id = v.tenant_id AND g.document_id = v.document_id
                      AND g.version_number = v.version_number)
   AND NOT EXISTS (SELECT 1 FROM document_erasure e
                    WHERE e.tenant_id = v.tenant_id AND e.document_id = v.document_id)
   AND NOT EXISTS (SELECT 1 FROM index_task t
                    WHERE t.tenant_id = v.tenant_id AND t.document_id = v.document_id
                      AND t.version_number = v.version_number
                      AND t.status NOT IN ('SUCCEEDED', 'DEAD'))
 ORDER BY v.superseded_at, v.tenant_id, v.document_id, v.version_number
 LIMIT $2::integer
   FOR NO KEY UPDATE OF v SKIP LOCKED

-- name: hold_finished_tasks
-- $1 tenants, $2 documents, $3 versions (the batch's). Their finished tasks, FOR SHARE until
-- the batch commits: an operator's requeue or a repair's re-run (an UPDATE of the row) waits
-- for the batch, and then finds the content gone (the indexer ends it with
-- VERSION_CONTENT_REMOVED). A task requeued between take_retention_due's snapshot and this
-- lock no longer matches (its new state is re-checked) and is not held: the statements
-- below, each with a snapshot of its own, see it unfinished and leave its version alone.
-- Waits only for a completion or requeue of one of these rows in flight (short).
SELECT t.task_id
  FROM index_task t
  JOIN unnest($1::text[], $2::uuid[], $3::integer[]) AS k (tenant_id, document_id, version_number)
    ON t.tenant_id = k.tenant_id AND t.document_id = k.document_id
   AND t.version_number = k.version_number
 WHERE t.status IN ('SUCCEEDED', 'DEAD')
 ORDER BY t.task_id
   FOR SHARE OF t

-- name: delete_retained_chunks
-- $1 tenants, $2 documents, $3 versions (the batch's), $4 most rows. Their chunks, in every
-- generation (the chunk table holds them all), unless the version got an unfinished task
-- since it was taken. A version's chunks may take several batches; its content goes only
-- once none is left (remove_retained_content). The version of every row deleted comes back.
-- SKIP LOCKED: rows the collector of superseded chunks (gc.sql) is deleting at the same time
-- are left to it, never waited for, so the two never wait for each other in a cycle; the
-- version keeps its content until a later batch finds none of its chunks left.
WITH kept AS (
    SELECT k.tenant_id, k.document_id, k.version_number
      FROM unnest($1::text[], $2::uuid[], $3::integer[])
           AS k (tenant_id, document_id, version_number)
     WHERE NOT EXISTS (SELECT 1 FROM index_task t
                        WHERE t.tenant_id = k.tenant_id AND t.document_id = k.document_id
                          AND t.version_number = k.version_number
                          AND t.status NOT IN ('SUCCEEDED', 'DEAD'))
),
victim AS (
    SELECT c.tenant_id, c.document_id, c.version_number, c.embedding_model, c.chunk_id
      FROM knowledge_chunk c
      JOIN kept k ON c.tenant_id = k.tenant_id AND c.document_id = k.document_id
                 AND c.version_number = k.version_number
     LIMIT $4::integer
       FOR UPDATE OF c SKIP LOCKED
)
DELETE FROM knowledge_chunk c
 WHERE (c.tenant_id, c.document_id, c.version_number, c.embedding_model, c.chunk_id)
       IN (SELECT * FROM victim)
RETURNING c.version_number

-- name: remove_retained_content
-- $1 tenants, $2 documents, $3 versions (the batch's), $4 now. The content of each version
-- with no chunk left and no unfinished task: emptied, and content_removed_at set (the
-- version row, its hashes, size and times stay). The bytes removed come back per version.
-- The rows are locked by this transaction (take_retention_due): the old content read here
-- is the one replaced.
WITH gone AS (
    SELECT v.tenant_id, v.document_id, v.version_number, octet_length(v.content) AS bytes
      FROM document_version v
      JOIN unnest($1::text[], $2::uuid[], $3::integer[])
           AS k (tenant_id, document_id, version_number)
        ON v.tenant_id = k.tenant_id AND v.document_id = k.document_id
       AND v.version_number = k.version_number
     WHERE v.content_removed_at IS NULL
       AND NOT EXISTS (SELECT 1 FROM knowledge_chunk c
                        WHERE c.tenant_id = v.tenant_id AND c.document_id = v.document_id
                          AND c.version_number = v.version_number)
       AND NOT EXISTS (SELECT 1 FROM index_task t
                        WHERE t.tenant_id = v.tenant_id AND t.document_id = v.document_id
                          AND t.version_number = v.version_number
                          AND t.status NOT IN ('SUCCEEDED', 'DEAD'))
)
UPDATE document_version v
   SET content = ''::bytea,
       content_removed_at = coalesce($4::timestamptz, now())
  FROM gone g
 WHERE v.tenant_id = g.tenant_id
   AND v.document_id = g.document_id
   AND v.version_number = g.version_number
RETURNING v.tenant_id, v.document_id, v.version_number, g.bytes

-- name: retention_totals
-- What the lifecycle left, database-wide, for the sampled gauges (docs/metrics.md): deleted
-- documents, erasures done and in progress (and the oldest in progress), versions whose
-- content retention removed and their bytes (the size recorded at upload).
SELECT (SELECT count(*) FROM document WHERE deleted_at IS NOT NULL) AS deleted_documents,
       (SELECT count(*) FROM document_erasure WHERE erased_at IS NOT NULL) AS erased_documents,
       (SELECT count(*) FROM document_erasure WHERE erased_at IS NULL) AS erasures_in_progress,
       coalesce((SELECT extract(epoch FROM coalesce($1::timestamptz, now()) - min(requested_at))
                   FROM document_erasure WHERE erased_at IS NULL), 0)::float8
           AS oldest_erasure_in_progress_seconds,
       (SELECT count(*) FROM document_version WHERE content_removed_at IS NOT NULL)
           AS removed_versions,
       (SELECT coalesce(sum(size_bytes), 0) FROM document_version
         WHERE content_removed_at IS NOT NULL)::bigint AS removed_bytes
