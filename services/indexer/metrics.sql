-- Indexer gauges (docs/architecture.md#observability). Sampled by one process-wide sampler every few seconds, never
-- per slot or per claim. $1 tiers to report (text[]), $2 a third of the lease in seconds
-- (a lease ending within it is "expiring": its heartbeat is overdue), $3 now.

-- name: queue_gauges
-- Both halves read only the claim's partial indexes (index_task_due, index_task_running):
-- SUCCEEDED and DEAD rows, however many, are in neither. DEAD counts come from the
-- counters of the processes that buried them, and from `kb tasks list --status DEAD`.
WITH waiting AS (
    SELECT t.tier,
           count(*) FILTER (WHERE t.next_attempt_at <= coalesce($3::timestamptz, now())) AS due,
           count(*) FILTER (WHERE t.status = 'RETRY_WAIT'
                              AND t.next_attempt_at > coalesce($3::timestamptz, now()))
               AS retry_waiting,
           -- Publishes only: a backfill's tasks (priority 1, `kb index generations create`)
           -- wait behind them by design, and would page whoever watches this age.
           min(t.next_attempt_at) FILTER (WHERE t.next_attempt_at <= coalesce($3::timestamptz, now())
                                            AND t.priority = 0)
               AS oldest_due_at
      FROM index_task t
     WHERE t.status IN ('PENDING', 'RETRY_WAIT') AND t.tier = ANY ($1::text[])
     GROUP BY t.tier
),
running AS (
    SELECT t.tier,
           count(*) AS running,
           count(*) FILTER (WHERE t.lease_until > coalesce($3::timestamptz, now())
                              AND t.lease_until <= coalesce($3::timestamptz, now())
                                                   + make_interval(secs => $2))
               AS expiring,
           count(*) FILTER (WHERE t.lease_until <= coalesce($3::timestamptz, now())) AS expired
      FROM index_task t
     WHERE t.status = 'RUNNING' AND t.tier = ANY ($1::text[])
     GROUP BY t.tier
)
SELECT tier.name AS tier,
       coalesce(w.due, 0) AS due,
       coalesce(w.retry_waiting, 0) AS retry_waiting,
       extract(epoch FROM coalesce($3::timestamptz, now()) - w.oldest_due_at)::float8
           AS oldest_due_age_seconds,
       coalesce(r.running, 0) AS running,
       coalesce(r.expiring, 0) AS expiring,
       coalesce(r.expired, 0) AS expired
  FROM unnest($1::text[]) AS tier (name)
  LEFT JOIN waiting w ON w.tier = tier.name
  LEFT JOIN running r ON r.tier = tier.name

-- name: publish_to_switch_of_tasks
-- $1 the tasks this process completed since the last sample. Seconds from each version's
-- publish commit to the commit that switched search to it (only switches these tasks made:
-- a task for a version older than the pointer switched nothing and is not counted).
SELECT t.tier,
       extract(epoch FROM s.switched_at - v.published_at)::float8 AS seconds
  FROM index_task t
  JOIN document_search_version s
    ON s.tenant_id = t.tenant_id AND s.document_id = t.document_id
   AND s.version_number = t.version_number AND s.task_id = t.task_id
  JOIN document_version v
    ON v.tenant_id = t.tenant_id AND v.document_id = t.document_id
   AND v.version_number = t.version_number
 WHERE t.task_id = ANY ($1::uuid[])
   AND v.published_at IS NOT NULL
