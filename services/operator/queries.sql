-- The operator page's reads and its sign-in. Every list is bounded ($limit, keyset or
-- offset pages); every time-dependent query takes `now` as its last parameter.

-- name: find_operator_key
SELECT name FROM operator_key WHERE key_hash = $1 AND revoked_at IS NULL

-- name: create_operator_key
INSERT INTO operator_key (operator_id, name, key_hash)
VALUES ($1, $2, $3)
RETURNING operator_id

-- name: create_session
-- $1 session hash, $2 operator, $3 csrf token, $4 lifetime seconds, $5 now.
INSERT INTO operator_session (session_hash, operator_name, csrf_token, created_at, expires_at)
VALUES ($1, $2, $3, coalesce($5::timestamptz, now()),
        coalesce($5::timestamptz, now()) + make_interval(secs => $4))

-- name: find_session
SELECT operator_name, csrf_token
  FROM operator_session
 WHERE session_hash = $1 AND expires_at > coalesce($2::timestamptz, now())

-- name: delete_session
DELETE FROM operator_session WHERE session_hash = $1

-- name: delete_expired_sessions
DELETE FROM operator_session WHERE expires_at <= coalesce($1::timestamptz, now())

-- name: tier_overview
-- $1 "expiring" window in seconds, $2 now. One row per tier that has tenants. Each count
-- reads one partial index (index_task_due, index_task_running, index_task_dead).
SELECT t.tier,
       (SELECT count(*) FROM index_task x
         WHERE x.tier = t.tier AND x.status IN ('PENDING', 'RETRY_WAIT')
           AND x.next_attempt_at <= coalesce($2::timestamptz, now())) AS due,
       (SELECT extract(epoch FROM coalesce($2::timestamptz, now()) - min(x.next_attempt_at))
          FROM index_task x
         WHERE x.tier = t.tier AND x.status IN ('PENDING', 'RETRY_WAIT')
           AND x.next_attempt_at <= coalesce($2::timestamptz, now()))::float8
           AS oldest_due_age_seconds,
       (SELECT count(*) FROM index_task x
         WHERE x.tier = t.tier AND x.status = 'RETRY_WAIT'
           AND x.next_attempt_at > coalesce($2::timestamptz, now())) AS retry_waiting,
       (SELECT count(*) FROM index_task x
         WHERE x.tier = t.tier AND x.status = 'RUNNING') AS running,
       (SELECT count(*) FROM index_task x
         WHERE x.tier = t.tier AND x.status = 'RUNNING'
           AND x.lease_until > coalesce($2::timestamptz, now())
           AND x.lease_until <= coalesce($2::timestamptz, now()) + make_interval(secs => $1))
           AS leases_expiring,
       (SELECT count(*) FROM index_task x
         WHERE x.tier = t.tier AND x.status = 'RUNNING'
           AND x.lease_until <= coalesce($2::timestamptz, now())) AS leases_expired,
       (SELECT count(*) FROM index_task x
         WHERE x.tier = t.tier AND x.status = 'DEAD') AS dead
  FROM (SELECT DISTINCT tier FROM tenant) AS t
 ORDER BY t.tier

-- name: relay_partitions
SELECT partition, owner, epoch, lease_until,
       coalesce(lease_until > coalesce($1::timestamptz, now()), false) AS held,
       progressed_at
  FROM relay_partition
 ORDER BY partition

-- name: database_now
-- $1 now: the instant the page's time windows end at (the database's clock unless pinned).
SELECT coalesce($1::timestamptz, now())

-- name: tasks_per_minute
-- $1 since, $2 now. Finished tasks per minute (SUCCEEDED, DEAD) over the index on finished_at.
SELECT date_trunc('minute', finished_at) AS minute, status, count(*) AS tasks
  FROM index_task
 WHERE finished_at >= $1 AND finished_at <= coalesce($2::timestamptz, now())
   AND status IN ('SUCCEEDED', 'DEAD')
 GROUP BY 1, 2
 ORDER BY 1

-- name: publish_to_switch_in_window
-- $1 since, $2 now. Seconds from each version's publish to the switch that served it, for
-- the switches in the window (the current pointers only: one row per document).
SELECT date_trunc('minute', s.switched_at) AS minute,
       extract(epoch FROM s.switched_at - v.published_at)::float8 AS seconds
  FROM document_search_version s
  JOIN document_version v
    ON v.tenant_id = s.tenant_id AND v.document_id = s.document_id
   AND v.version_number = s.version_number
 WHERE s.switched_at >= $1 AND s.switched_at <= coalesce($2::timestamptz, now())
   AND v.published_at IS NOT NULL

-- name: tenants_page
-- $1 after tenant_id (keyset), $2 limit, $3 now (NULL: the database's). The ingest columns:
-- commands applied in the last 15 minutes, and the slowest of their delays from Kafka to
-- applied (docs/architecture.md#publish-by-event): a tenant whose commands wait; and its
-- backlog, the commands `kb ingest run` processes hold fetched and not yet applied (their
-- reports of the last minute), with how long the oldest of them has waited.
SELECT t.tenant_id, t.tier,
       (SELECT count(*) FROM document d WHERE d.tenant_id = t.tenant_id) AS documents,
       i.commands AS ingest_commands, i.max_delay_seconds AS ingest_max_delay_seconds,
       b.records AS ingest_backlog, b.oldest_seconds AS ingest_backlog_oldest_seconds
  FROM tenant t
  LEFT JOIN LATERAL (
       SELECT coalesce(sum(r.records), 0)::bigint AS records,
              extract(epoch FROM coalesce($3::timestamptz, now()) - min(r.oldest_sent_at))::float8
                  AS oldest_seconds
         FROM ingest_backlog r
        WHERE r.tenant_id = t.tenant_id
          AND r.reported_at >= coalesce($3::timestamptz, now()) - interval '1 minute') AS b
    ON true
  LEFT JOIN LATERAL (
       SELECT count(*) AS commands,
              max(extract(epoch FROM c.applied_at - c.sent_at))::float8 AS max_delay_seconds
         FROM ingest_command c
        WHERE c.tenant_id = t.tenant_id
          AND c.applied_at >= coalesce($3::timestamptz, now()) - interval '15 minutes') AS i
    ON true
 WHERE $1::text IS NULL OR t.tenant_id > $1
 ORDER BY t.tenant_id
 LIMIT $2

-- name: documents_page
-- $1 tenant, $2 offset, $3 limit, $4 now. The status mirrors the publisher's rule: DELETED
-- once deleted (an erased document too: the page's lifecycle view tells them apart), SEARCHABLE
-- when the search version is the published one, FAILED when the published version's task
-- is DEAD, INDEXING otherwise, NOT_PUBLISHED before the first publish.
SELECT d.document_id, d.title, d.published_version, d.published_at, d.updated_at,
       s.version_number AS search_version,
       t.status AS task_status, t.error_code, t.attempts,
       CASE WHEN d.deleted_at IS NOT NULL THEN 'DELETED'
            WHEN d.published_version IS NULL THEN 'NOT_PUBLISHED'
            WHEN s.version_number = d.published_version THEN 'SEARCHABLE'
            WHEN t.status = 'DEAD' THEN 'FAILED'
            ELSE 'INDEXING' END AS index_status,
       CASE WHEN d.published_version IS NOT NULL AND d.deleted_at IS NULL
             AND s.version_number IS DISTINCT FROM d.published_version
            THEN extract(epoch FROM coalesce($4::timestamptz, now()) - d.published_at)::float8
       END AS lag_seconds
  FROM document d
  LEFT JOIN document_search_version s
         ON s.tenant_id = d.tenant_id AND s.document_id = d.document_id
  LEFT JOIN index_task t
         ON t.tenant_id = d.tenant_id AND t.document_id = d.document_id
        AND t.version_number = d.published_version AND t.task_type = 'INDEX_VERSION'
        AND t.generation_id IS NULL
 WHERE d.tenant_id = $1
 ORDER BY d.updated_at DESC, d.document_id
 OFFSET $2
 LIMIT $3

-- name: count_documents
SELECT count(*) FROM document WHERE tenant_id = $1

-- name: document_header
-- The document, its search pointer (a tombstone once deleted: no version served) and its
-- erasure audit row, if any (erased_at NULL: the erase is in progress).
SELECT d.document_id, d.tenant_id, d.title, d.revision, d.latest_version,
       d.published_version, d.published_at, d.deleted_at,
       CASE WHEN s.deleted_at IS NULL THEN s.version_number END AS search_version,
       s.embedding_model, s.switched_at,
       e.requested_by AS erase_requested_by, e.key_id AS erase_key_id,
       e.requested_at AS erase_requested_at, e.erased_at
  FROM document d
  LEFT JOIN document_search_version s
         ON s.tenant_id = d.tenant_id AND s.document_id = d.document_id
  LEFT JOIN document_erasure e
         ON e.tenant_id = d.tenant_id AND e.document_id = d.document_id
 WHERE d.tenant_id = $1 AND d.document_id = $2

-- name: document_versions
SELECT version_number, media_type, size_bytes, status, created_at, published_at,
       superseded_at, content_removed_at
  FROM document_version
 WHERE tenant_id = $1 AND document_id = $2
 ORDER BY version_number DESC
 LIMIT $3

-- name: document_tasks
SELECT t.task_id, t.version_number, t.status, t.attempts, t.max_attempts, t.lease_owner,
       t.lease_until, t.next_attempt_at, t.error_code, t.error_message, t.created_at,
       t.updated_at, t.finished_at,
       (SELECT count(*) FROM index_task_requeue r WHERE r.task_id = t.task_id) AS requeues
  FROM index_task t
 WHERE t.tenant_id = $1 AND t.document_id = $2
 ORDER BY t.version_number DESC, t.created_at DESC
 LIMIT $3

-- name: document_chunks
-- $1 tenant, $2 document, $3 offset, $4 limit. The chunks queries read: those of the
-- document's current search version.
SELECT c.chunk_id, c.ordinal, c.heading_path, left(c.text, 400) AS text
  FROM (
        -- include: current_version_chunks from services/runtime/indexing/search_version.sql
       ) AS c
 WHERE c.tenant_id = $1 AND c.document_id = $2
 ORDER BY c.ordinal
 OFFSET $3
 LIMIT $4

-- name: count_document_chunks
-- $1 tenant, $2 document: how many chunks document_chunks pages through.
SELECT count(*)
  FROM (
        -- include: current_version_chunks from services/runtime/indexing/search_version.sql
       ) AS c
 WHERE c.tenant_id = $1 AND c.document_id = $2

-- name: dead_tasks_page
-- $1 tier, $2 tenant, $3 error code (each optional), $4 offset, $5 limit. Newest first.
-- Reads index_task_dead only. The last requeue (who, when) is shown for context.
SELECT t.task_id, t.tier, t.tenant_id, t.document_id, t.version_number, t.attempts,
       t.max_attempts, t.error_code, t.error_message, t.finished_at
  FROM index_task t
 WHERE t.status = 'DEAD'
   AND ($1::text IS NULL OR t.tier = $1)
   AND ($2::text IS NULL OR t.tenant_id = $2)
   AND ($3::text IS NULL OR t.error_code = $3)
 ORDER BY t.finished_at DESC NULLS LAST, t.task_id
 OFFSET $4
 LIMIT $5

-- name: count_dead_tasks
SELECT count(*)
  FROM index_task t
 WHERE t.status = 'DEAD'
   AND ($1::text IS NULL OR t.tier = $1)
   AND ($2::text IS NULL OR t.tenant_id = $2)
   AND ($3::text IS NULL OR t.error_code = $3)

-- name: recent_requeues
-- The audit lines shown on the dead-task page: who requeued what, and when.
SELECT r.task_id, r.requeued_by, r.requeued_at, r.previous_error_code, t.tenant_id,
       t.status
  FROM index_task_requeue r
  JOIN index_task t ON t.task_id = r.task_id
 ORDER BY r.requeue_id DESC
 LIMIT $1

-- name: lifecycle_totals
-- $1 now, $2 the retention period in days (0: keep forever). The overview's and the
-- lifecycle page's counts: deleted documents, erasures done and in progress, versions whose
-- content retention removed (and their bytes as uploaded), and those due now.
SELECT (SELECT count(*) FROM document WHERE deleted_at IS NOT NULL) AS deleted,
       (SELECT count(*) FROM document_erasure WHERE erased_at IS NOT NULL) AS erased,
       (SELECT count(*) FROM document_erasure WHERE erased_at IS NULL) AS erasing,
       (SELECT count(*) FROM document_version WHERE content_removed_at IS NOT NULL)
           AS removed_versions,
       (SELECT coalesce(sum(size_bytes), 0) FROM document_version
         WHERE content_removed_at IS NOT NULL)::bigint AS removed_bytes,
       (SELECT count(*) FROM document_version
         WHERE superseded_at IS NOT NULL AND content_removed_at IS NULL
           AND $2::integer > 0
           AND superseded_at <= coalesce($1::timestamptz, now())
                                - make_interval(days => $2::integer)) AS retention_due

-- name: recent_deletes
-- $1 limit. The documents deleted last, newest first (ids and times only: a deleted
-- document's title is shown on its own page until it is erased).
SELECT d.tenant_id, d.document_id, d.deleted_at, e.erased_at,
       e.requested_at AS erase_requested_at
  FROM document d
  LEFT JOIN document_erasure e
         ON e.tenant_id = d.tenant_id AND e.document_id = d.document_id
 WHERE d.deleted_at IS NOT NULL
 ORDER BY d.deleted_at DESC, d.tenant_id, d.document_id
 LIMIT $1

-- name: recent_erasures
-- $1 limit. The erasure audit (migration 0031): who asked (the key, or the CLI), when, and
-- when it finished; in progress first, then newest first. No content: there is none left.
SELECT e.tenant_id, e.document_id, e.requested_by, e.key_id, e.requested_at, e.erased_at
  FROM document_erasure e
 ORDER BY e.erased_at IS NOT NULL, e.requested_at DESC, e.tenant_id, e.document_id
 LIMIT $1

-- name: recent_retention
-- $1 limit. The versions whose content retention removed last: which, how large, when
-- superseded and when removed.
SELECT v.tenant_id, v.document_id, v.version_number, v.size_bytes, v.superseded_at,
       v.content_removed_at
  FROM document_version v
 WHERE v.content_removed_at IS NOT NULL
 ORDER BY v.content_removed_at DESC, v.tenant_id, v.document_id, v.version_number
 LIMIT $1
