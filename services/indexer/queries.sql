-- Index task queue (DESIGN §4). Every time-dependent query takes `now` as its last
-- parameter: NULL means the database clock, a value is a test's injected time.

-- name: claim_tasks
-- $1 tier, $2 owner, $3 lease seconds, $4 how many to claim, $5 candidates to consider,
-- $6 how many exhausted leases to bury, $7 now.
--
-- One statement, one short transaction, no lock held once it returns.
--
-- 1. `exhausted` marks DEAD (LEASE_ATTEMPTS_EXHAUSTED) RUNNING tasks of the tier whose lease
--    expired with the attempt budget spent, at most $6 per claim, skipping rows another
--    transaction holds (a worker completing it right now, or another claimer burying it).
--
-- 2. Fairness rule, in ROUNDS. Round 0 is every expired lease with budget left (a takeover;
--    these have waited longest). Otherwise a tenant's k-th oldest due task is in round
--    (k + the tenant's RUNNING tasks in this tier): a tenant's second task is never
--    claimed before every other tenant's first, and a tenant that already holds workers
--    yields to one that holds none. Within a round, tenants take turns: they are ordered by
--    (their rank by tenant_id + turn) mod T, where T is the number of tenants with due work
--    and `turn` comes from a sequence that every claim advances (lock-free, never rolled
--    back), so each claim starts the round at the next tenant. Hence: a tenant with 10,000
--    due tasks delays another tenant's single task by at most one round -- at most T - 1
--    claims in a row, whatever its backlog or its tasks' age -- and concurrent claimers
--    (which all skip each other's locked rows down the same list) serve it in the same
--    round. Tenants are found with a skip scan over index_task_due_by_tenant (one index
--    probe per tenant with due work); each tenant contributes at most ceil($5 / T)
--    candidates, so a claim reads O(T + $5) index entries whatever the backlog, and
--    SUCCEEDED/DEAD rows are in none of the partial indexes it reads. Both probes of
--    `tenant_with_work` must filter on next_attempt_at <= now like the candidates do: a
--    tenant whose queued tasks are all in the future (RETRY_WAIT backing off) counted in T
--    would shrink every tenant's share ceil($5 / T) to 1 and starve the claim. The filter is
--    an index condition on the index's last column; PostgreSQL 18's btree skip scan jumps
--    over such a tenant's future entries instead of reading them (EXPLAIN: a few "Index
--    Searches" and no more buffers for a tenant with 10,000 future tasks).
--
-- 3. `locked` takes candidates in round order FOR UPDATE SKIP LOCKED, up to $4. Why it cannot
--    double-claim: a row a concurrent claimer has locked is skipped, not waited for; a row
--    another transaction claimed and committed after our snapshot is re-read under the row
--    lock (READ COMMITTED re-check), and the WHERE below no longer holds for it (RUNNING with
--    a fresh lease), so it is dropped. $5 is larger than $4 so that concurrent claimers
--    that skip each other's rows still find work in the same statement.
--
-- 4. The UPDATE makes them RUNNING with attempts + 1: the new lease generation
--    (lease_attempt) every later write must present.
WITH RECURSIVE
exhausted AS (
    UPDATE index_task t
       SET status = 'DEAD',
           lease_until = NULL,
           error_code = 'LEASE_ATTEMPTS_EXHAUSTED',
           error_message = 'lease expired ' || t.attempts || ' times; attempt budget '
                           || t.max_attempts || ' spent',
           updated_at = coalesce($7::timestamptz, now()),
           finished_at = coalesce($7::timestamptz, now())
     WHERE t.task_id IN (
               SELECT x.task_id
                 FROM index_task x
                WHERE x.tier = $1
                  AND x.status = 'RUNNING'
                  AND x.lease_until <= coalesce($7::timestamptz, now())
                  AND x.attempts >= x.max_attempts
                LIMIT $6
                  FOR UPDATE OF x SKIP LOCKED)
    RETURNING t.task_id
),
tenant_with_work (tenant_id) AS (
    (SELECT q.tenant_id
       FROM index_task q
      WHERE q.tier = $1 AND q.status IN ('PENDING', 'RETRY_WAIT')
        AND q.next_attempt_at <= coalesce($7::timestamptz, now())
      ORDER BY q.tenant_id
      LIMIT 1)
    UNION ALL
    SELECT (SELECT q.tenant_id
              FROM index_task q
             WHERE q.tier = $1 AND q.status IN ('PENDING', 'RETRY_WAIT')
               AND q.tenant_id > w.tenant_id
               AND q.next_attempt_at <= coalesce($7::timestamptz, now())
             ORDER BY q.tenant_id
             LIMIT 1)
      FROM tenant_with_work w
     WHERE w.tenant_id IS NOT NULL
),
rotation AS MATERIALIZED (
    SELECT nextval('index_task_claim_turn') AS turn
),
tenant_turn AS MATERIALIZED (
    SELECT w.tenant_id,
           (row_number() OVER (ORDER BY w.tenant_id) + (SELECT turn FROM rotation))
               % count(*) OVER () AS position,
           count(*) OVER () AS tenants
      FROM tenant_with_work w
     WHERE w.tenant_id IS NOT NULL
),
running_per_tenant AS (
    SELECT r.tenant_id, count(*) AS running
      FROM index_task r
     WHERE r.tier = $1 AND r.status = 'RUNNING'
     GROUP BY r.tenant_id
),
candidate AS MATERIALIZED (
    SELECT u.task_id, u.round, u.position, u.due_at
      FROM (
            (SELECT r.task_id, 0::bigint AS round, 0::bigint AS position, r.lease_until AS due_at
               FROM index_task r
              WHERE r.tier = $1
                AND r.status = 'RUNNING'
                AND r.lease_until <= coalesce($7::timestamptz, now())
                AND r.attempts < r.max_attempts
              ORDER BY r.lease_until
              LIMIT $5)
            UNION ALL
            SELECT d.task_id, d.round + coalesce(rp.running, 0), o.position, d.next_attempt_at
              FROM tenant_turn o
              LEFT JOIN running_per_tenant rp ON rp.tenant_id = o.tenant_id
             CROSS JOIN LATERAL (
                   SELECT q.task_id, q.next_attempt_at,
                          row_number() OVER (ORDER BY q.next_attempt_at, q.task_id) AS round
                     FROM index_task q
                    WHERE q.tier = $1
                      AND q.tenant_id = o.tenant_id
                      AND q.status IN ('PENDING', 'RETRY_WAIT')
                      AND q.next_attempt_at <= coalesce($7::timestamptz, now())
                    ORDER BY q.next_attempt_at, q.task_id
                    LIMIT (SELECT ceil($5::numeric / max(t.tenants))::bigint FROM tenant_turn t)
                   ) d
           ) u
     ORDER BY u.round, u.position, u.due_at, u.task_id
     LIMIT $5
),
locked AS MATERIALIZED (
    SELECT t.task_id
      FROM candidate c
      JOIN index_task t ON t.task_id = c.task_id
     WHERE t.tier = $1
       AND (   (t.status IN ('PENDING', 'RETRY_WAIT')
                AND t.next_attempt_at <= coalesce($7::timestamptz, now()))
            OR (t.status = 'RUNNING'
                AND t.lease_until <= coalesce($7::timestamptz, now())
                AND t.attempts < t.max_attempts))
     ORDER BY c.round, c.position, c.due_at, c.task_id
     LIMIT $4
       FOR UPDATE OF t SKIP LOCKED
)
UPDATE index_task t
   SET status = 'RUNNING',
       attempts = t.attempts + 1,
       lease_owner = $2,
       lease_until = coalesce($7::timestamptz, now()) + make_interval(secs => $3),
       updated_at = coalesce($7::timestamptz, now())
  FROM locked l
 WHERE t.task_id = l.task_id
RETURNING t.task_id, t.tenant_id, t.document_id, t.version_number, t.task_type, t.tier,
          t.attempts AS lease_attempt, t.max_attempts, t.lease_owner, t.lease_until

-- name: heartbeat
-- The fence (DESIGN §4): RUNNING, our owner, our generation, lease not yet expired. Only
-- lease_until and updated_at change, neither is indexed, and the table's fillfactor leaves
-- room on the page: a heartbeat is a HOT update that touches no index.
UPDATE index_task
   SET lease_until = coalesce($5::timestamptz, now()) + make_interval(secs => $4),
       updated_at = coalesce($5::timestamptz, now())
 WHERE task_id = $1
   AND status = 'RUNNING'
   AND lease_owner = $2
   AND attempts = $3
   AND lease_until > coalesce($5::timestamptz, now())
RETURNING lease_until

-- name: complete_task
-- Same fence. Run inside the caller's transaction: the row lock taken here is held until
-- commit, so the sink's writes that follow in the same transaction cannot race a takeover.
UPDATE index_task
   SET status = 'SUCCEEDED',
       lease_until = NULL,
       error_code = NULL,
       error_message = NULL,
       updated_at = coalesce($4::timestamptz, now()),
       finished_at = coalesce($4::timestamptz, now())
 WHERE task_id = $1
   AND status = 'RUNNING'
   AND lease_owner = $2
   AND attempts = $3
   AND lease_until > coalesce($4::timestamptz, now())
RETURNING task_id

-- name: fail_task
-- Same fence. $4 is RETRY_WAIT or DEAD as the retry policy decided from the error code.
UPDATE index_task
   SET status = $4::text,
       lease_until = NULL,
       next_attempt_at = coalesce($8::timestamptz, now()) + make_interval(secs => $5),
       error_code = $6,
       error_message = $7,
       updated_at = coalesce($8::timestamptz, now()),
       finished_at = CASE WHEN $4::text = 'DEAD' THEN coalesce($8::timestamptz, now()) END
 WHERE task_id = $1
   AND status = 'RUNNING'
   AND lease_owner = $2
   AND attempts = $3
   AND lease_until > coalesce($8::timestamptz, now())
   AND $4::text IN ('RETRY_WAIT', 'DEAD')
RETURNING *

-- name: get_task
SELECT * FROM index_task WHERE task_id = $1

-- name: list_tasks
-- Operators' view; every filter optional. Newest changes first.
SELECT *
  FROM index_task
 WHERE ($1::text IS NULL OR status = $1)
   AND ($2::text IS NULL OR tenant_id = $2)
   AND ($3::text IS NULL OR tier = $3)
 ORDER BY updated_at DESC, task_id
 LIMIT $4

-- name: requeue_task
-- $1 task, $2 who, $3 reset the budget?, $4 budget, $5 now. Only a DEAD task; the row lock
-- makes two concurrent requeues of one task produce one audit row (the second finds the
-- task no longer DEAD after the lock wait and requeues nothing). `attempts` is kept: it is
-- the fencing generation and must never repeat; the budget moves via max_attempts.
WITH target AS (
    SELECT task_id, attempts, max_attempts, error_code, error_message
      FROM index_task
     WHERE task_id = $1 AND status = 'DEAD'
       FOR UPDATE
),
requeued AS (
    UPDATE index_task t
       SET status = 'PENDING',
           max_attempts = g.attempts + CASE WHEN $3::boolean THEN $4::integer ELSE 1 END,
           lease_until = NULL,
           next_attempt_at = coalesce($5::timestamptz, now()),
           error_code = NULL,
           error_message = NULL,
           updated_at = coalesce($5::timestamptz, now()),
           finished_at = NULL
      FROM target g
     WHERE t.task_id = g.task_id
    RETURNING t.task_id, t.max_attempts
)
INSERT INTO index_task_requeue (task_id, requeued_by, requeued_at, reset_attempts, attempts,
                                previous_max_attempts, new_max_attempts, previous_error_code,
                                previous_error_message)
SELECT g.task_id, $2, coalesce($5::timestamptz, now()), $3::boolean, g.attempts,
       g.max_attempts, r.max_attempts, g.error_code, g.error_message
  FROM target g
  JOIN requeued r ON r.task_id = g.task_id
RETURNING *

-- name: load_document_version
-- Tenant-scoped: the tenant is part of the key, never inferred from the document id alone.
SELECT content, media_type, sha256, size_bytes, status
  FROM document_version
 WHERE tenant_id = $1 AND document_id = $2 AND version_number = $3

-- name: requeue_history
SELECT *
  FROM index_task_requeue
 WHERE task_id = $1
 ORDER BY requeue_id
