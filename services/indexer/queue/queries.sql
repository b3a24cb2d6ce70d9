-- Index task queue (docs/architecture.md#index-tasks). Every time-dependent query takes
-- `now` as its last parameter: NULL means the database clock, a value is a test's injected
-- time.

-- name: claim_tasks
-- $1 tier, $2 owner, $3 lease seconds, $4 how many to claim, $5 candidates to consider,
-- $6 how many exhausted leases to report for burial, $7 now.
--
-- One statement, one short transaction, no lock held once it returns.
--
-- 1. `exhausted` finds up to $6 RUNNING tasks of the tier whose lease expired with the
--    attempt budget spent, and returns their ids (a row each, `exhausted` true) beside the
--    claimed leases; it locks and changes nothing. The caller buries them with
--    `bury_exhausted`, in a transaction of its own that also writes each one's
--    DocumentIndexingFailed (failed.py): the claim itself stays one autocommitted
--    statement, and only a claim that found such a task pays for that transaction.
--
-- 2. Fairness rule, in ROUNDS. Round 0 is every expired lease with budget left (a takeover;
--    these have waited longest), oldest lease first. Otherwise a tenant's k-th due
--    task is in round (k + the tenant's RUNNING tasks in this tier): a tenant's second task
--    is never claimed before every other tenant's first, and a tenant that already holds
--    workers yields to one that holds none. Within a round, tenants take turns: they are
--    ordered by (their rank by tenant_id + turn) mod T, where T is the number of tenants
--    with due work and `turn` comes from a sequence that every claim advances (lock-free,
--    never rolled back), so each claim starts the round at the next tenant. Hence: a tenant
--    with 10,000 due tasks delays another tenant's single task by at most one round -- the
--    single task is in round 1 + its tenant's RUNNING count and the big tenant has one task
--    per round, so at most T - 1 claims go first, whatever its backlog or its tasks' age --
--    and concurrent claimers (which all skip each other's locked rows down the same list)
--    serve it in the same round. Within a tenant, due tasks go in (priority, next_attempt_at)
--    order: its publishes (priority 0) before its backfills (priority 1, `kb index
--    generations create`), however old the backfill's tasks, so a backfill never delays the
--    tenant's new publishes; the fair share across tenants is the same whatever the
--    priorities. Tasks of one tenant due at the same instant go in index order.
--
--    `tenant_head` finds the tenants with due work with a skip scan over
--    index_task_due_by_tenant (tier, tenant_id, priority, next_attempt_at): one probe per
--    tenant, in tenant_id order (hence its rank), returns that tenant's first due task in
--    that order; one more probe finds no further tenant. The probe filters on
--    next_attempt_at <= now like every candidate: a tenant whose queued tasks are all in the
--    future (RETRY_WAIT backing off) counted in T would shrink every tenant's share
--    ceil($5 / T) to 1 and starve the claim. The filter is an index condition on the
--    index's last column; PostgreSQL 18's btree skip scan jumps over such a tenant's future
--    entries (and over the two priorities) instead of reading them.
--
--    `slot` is the candidate list: the takeovers, then for each tenant the slots
--    k = 1 .. ceil($5 / T), slot k in round k + its RUNNING count, sorted by round and turn
--    and cut at 2 * $5 slots. A slot is not yet a task, so the list is cheap to build;
--    `candidate` names the task of a slot only when the locking below reaches it (a
--    sub-select in its select list, above the sort, so evaluated for the rows actually
--    read; it repeats the ORDER BY so that the walk below needs no sort of its own): slot 1
--    is the task the skip scan returned, slot 2 costs one probe of two index entries, and
--    the first time a slot k > 2 is reached, `later_task` (MATERIALIZED: computed once, on
--    first use) reads every tenant's 2nd to ceil($5 / T)-th due tasks, one probe per
--    tenant, for the slots to look up. A tenant with fewer due tasks leaves slots empty;
--    fewer than $5 slots can be empty in all, so the cut list still holds the rule's first
--    $5 candidates. So a claim reads O(T + $5) index entries whatever the backlog -- T + 1
--    skip-scan probes, the rest only as deep as the locking goes -- and SUCCEEDED/DEAD rows
--    are in none of the partial indexes it reads.
--
-- 3. `locked` walks the candidates in round order and locks each one's row FOR UPDATE SKIP
--    LOCKED, until it holds $4. Why it cannot double-claim: a row a concurrent claimer has
--    locked is skipped, not waited for; a row another transaction claimed and committed
--    after our snapshot is re-read under the row lock (READ COMMITTED re-check), and the
--    WHERE of the locking sub-select no longer holds for it (RUNNING with a fresh lease), so
--    it is dropped. The lock is taken in a LATERAL sub-select, one candidate at a time in
--    list order, so the walk stops at the $4-th row it holds and never resolves or locks a
--    candidate it does not need. The list holds $5 candidates (or every due task), more
--    than $4, so that concurrent claimers that skip each other's rows still find work in
--    the same statement.
--
-- 4. The UPDATE makes them RUNNING with attempts + 1: the new lease generation
--    (lease_attempt) every later write must present.
--
-- Plan: asyncpg prepares the statement, and PostgreSQL keeps a generic plan only while it
-- is not costlier than the custom plans of the first five executions; otherwise it plans
-- every claim anew, a planning cost paid by every claim. So no estimate that decides the
-- plan may depend on a parameter's value: every LIMIT reads its parameter through a scalar
-- sub-select, and the tier and `now` reach the probes and the re-check as columns (`tier`,
-- `due_by`) rather than as parameters, which a custom plan would estimate from the column
-- statistics.
-- Custom and generic plans then cost the same and the generic one is kept: nested loops
-- over the partial indexes and the primary key, the same whatever the table's size.
WITH RECURSIVE
exhausted AS (
    SELECT x.task_id
      FROM index_task x
     WHERE x.tier = $1
       AND x.status = 'RUNNING'
       AND x.lease_until <= coalesce($7::timestamptz, now())
       AND x.attempts >= x.max_attempts
     LIMIT (SELECT $6::integer)
),
tenant_head (tier, due_by, tenant_id, task_id, rank) AS (
    SELECT a.tier, a.due_by, n.tenant_id, n.task_id, 1::bigint
      -- OFFSET 0: tier and now become columns the planner cannot see through (see Plan).
      FROM (SELECT $1::text AS tier, coalesce($7::timestamptz, now()) AS due_by OFFSET 0) a
     CROSS JOIN LATERAL (
           SELECT q.tenant_id, q.task_id
             FROM index_task q
            WHERE q.tier = a.tier AND q.status IN ('PENDING', 'RETRY_WAIT')
              AND q.next_attempt_at <= a.due_by
            ORDER BY q.tenant_id, q.priority, q.next_attempt_at
            LIMIT 1) n
    UNION ALL
    SELECT h.tier, h.due_by, n.tenant_id, n.task_id, h.rank + 1
      FROM tenant_head h
     CROSS JOIN LATERAL (
           SELECT q.tenant_id, q.task_id
             FROM index_task q
            WHERE q.tier = h.tier AND q.status IN ('PENDING', 'RETRY_WAIT')
              AND q.tenant_id > h.tenant_id
              AND q.next_attempt_at <= h.due_by
            ORDER BY q.tenant_id, q.priority, q.next_attempt_at
            LIMIT 1) n
),
running_per_tenant AS (
    SELECT r.tenant_id, count(*) AS running
      FROM index_task r
     WHERE r.tier = $1 AND r.status = 'RUNNING'
     GROUP BY r.tenant_id
),
tenant_turn AS (
    SELECT h.tier, h.due_by, h.tenant_id, h.task_id AS first_task,
           coalesce(rp.running, 0) AS running,
           (h.rank + (SELECT nextval('index_task_claim_turn'))) % count(*) OVER () AS position,
           (($5::integer + count(*) OVER () - 1) / count(*) OVER ())::integer AS share
      FROM tenant_head h
      LEFT JOIN running_per_tenant rp ON rp.tenant_id = h.tenant_id
),
slot AS (
    SELECT r.task_id, 0::bigint AS round, 0::bigint AS position, r.lease_until AS due_at,
           NULL::text AS tenant_id, 1::bigint AS k,
           $1::text AS tier, coalesce($7::timestamptz, now()) AS due_by
      FROM index_task r
     WHERE r.tier = $1
       AND r.status = 'RUNNING'
       AND r.lease_until <= coalesce($7::timestamptz, now())
       AND r.attempts < r.max_attempts
    UNION ALL
    -- unnest(array_fill(..)) rather than generate_series: a row estimate of 10, not 1000.
    SELECT o.first_task, g.k + o.running, o.position, NULL, o.tenant_id, g.k, o.tier, o.due_by
      FROM tenant_turn o
     CROSS JOIN LATERAL unnest(array_fill(0, ARRAY[o.share])) WITH ORDINALITY AS g (z, k)
),
later_task AS MATERIALIZED (
    SELECT o.tenant_id, d.task_id, d.k + 1 AS k
      FROM tenant_turn o
     CROSS JOIN LATERAL unnest(ARRAY(
           SELECT q.task_id
             FROM index_task q
            WHERE q.tier = o.tier
              AND q.tenant_id = o.tenant_id
              AND q.status IN ('PENDING', 'RETRY_WAIT')
              AND q.next_attempt_at <= o.due_by
              AND q.task_id <> o.first_task
            ORDER BY q.priority, q.next_attempt_at
            LIMIT o.share - 1)) WITH ORDINALITY AS d (task_id, k)
),
candidate AS (
    SELECT c.round, c.position, c.due_at, c.tier, c.due_by,
           CASE WHEN c.k = 1 THEN c.task_id
                WHEN c.k = 2 THEN (SELECT q.task_id
                                     FROM index_task q
                                    WHERE q.tier = c.tier
                                      AND q.tenant_id = c.tenant_id
                                      AND q.status IN ('PENDING', 'RETRY_WAIT')
                                      AND q.next_attempt_at <= c.due_by
                                      AND q.task_id <> c.task_id
                                    ORDER BY q.priority, q.next_attempt_at
                                    LIMIT 1)
                ELSE (SELECT l.task_id FROM later_task l
                       WHERE l.tenant_id = c.tenant_id AND l.k = c.k)
           END AS task_id
      FROM (SELECT s.*
              FROM slot s
             ORDER BY s.round, s.position, s.due_at, s.task_id
             LIMIT (SELECT 2 * $5::integer)) c
     ORDER BY c.round, c.position, c.due_at
),
locked AS MATERIALIZED (
    SELECT l.task_id
      FROM candidate c
     CROSS JOIN LATERAL (
           SELECT t.task_id
             FROM index_task t
            WHERE t.task_id = c.task_id
              AND t.tier = c.tier
              AND (   (t.status IN ('PENDING', 'RETRY_WAIT') AND t.next_attempt_at <= c.due_by)
                   OR (t.status = 'RUNNING' AND t.lease_until <= c.due_by
                       AND t.attempts < t.max_attempts))
              FOR UPDATE SKIP LOCKED) l
     ORDER BY c.round, c.position, c.due_at
     LIMIT (SELECT $4::integer)
),
claimed AS (
    UPDATE index_task t
       SET status = 'RUNNING',
           attempts = t.attempts + 1,
           lease_owner = $2,
           lease_until = coalesce($7::timestamptz, now()) + make_interval(secs => $3),
           updated_at = coalesce($7::timestamptz, now())
      FROM locked l
     WHERE t.task_id = l.task_id
    RETURNING t.task_id, t.tenant_id, t.document_id, t.version_number, t.task_type, t.tier,
              t.attempts AS lease_attempt, t.max_attempts, t.lease_owner, t.lease_until,
              t.generation_id, t.traceparent, false AS exhausted
)
SELECT * FROM claimed
UNION ALL
SELECT e.task_id, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, true
  FROM exhausted e

-- name: bury_exhausted
-- $1 tasks claim_tasks found exhausted, $2 now. Marks DEAD (LEASE_ATTEMPTS_EXHAUSTED) those
-- still RUNNING with their lease expired and the attempt budget spent, skipping rows another
-- transaction holds (a worker completing it right now, or another claimer burying it); the
-- READ COMMITTED re-check under the row lock drops a row changed since, so each task is
-- buried, and announced, once. Returns the buried rows with `command_id` (the ingest
-- command that created the task, as sink.sql's switch_search_version finds it): its caller
-- writes their DocumentIndexingFailed in this statement's transaction (failed.py).
--
-- `buried_stream` deletes their staged chunks (knowledge_chunk_stream) with them: no attempt
-- of theirs will run again to do it. It reads the rows committed when this statement began.
-- A slice whose fence passed before the lease expired and that commits while this statement
-- runs is not among them (a slice holding the row when the lock comes makes SKIP LOCKED pass
-- the task over, to be buried by a later claim; one that committed just before the lock
-- does not). Such rows stay until the task is requeued and its next attempt streams (its
-- first slice deletes every earlier attempt's rows). It takes a slice transaction open
-- across the expiry of its lease: heartbeats failing for a whole lease while the worker
-- still writes.
WITH exhausted AS (
    UPDATE index_task t
       SET status = 'DEAD',
           lease_until = NULL,
           error_code = 'LEASE_ATTEMPTS_EXHAUSTED',
           error_message = 'lease expired ' || t.attempts || ' times; attempt budget '
                           || t.max_attempts || ' spent',
           updated_at = coalesce($2::timestamptz, now()),
           finished_at = coalesce($2::timestamptz, now())
      FROM (SELECT x.task_id
              FROM index_task x
             WHERE x.task_id = ANY($1::uuid[])
               AND x.status = 'RUNNING'
               AND x.lease_until <= coalesce($2::timestamptz, now())
               AND x.attempts >= x.max_attempts
             ORDER BY x.task_id
               FOR UPDATE OF x SKIP LOCKED) x
     WHERE t.task_id = x.task_id
    RETURNING t.*
),
buried_stream AS (
    DELETE FROM knowledge_chunk_stream s
     USING exhausted e
     WHERE s.task_id = e.task_id
)
SELECT e.*,
       (SELECT c.command_id
          FROM ingest_command AS c
         WHERE c.tenant_id = e.tenant_id AND c.task_id = e.task_id
         ORDER BY c.applied_at, c.command_id
         LIMIT 1) AS command_id
  FROM exhausted e

-- name: heartbeat
-- The fence (docs/architecture.md#leases-and-fencing): RUNNING, our owner, our generation,
-- lease not yet expired. Only lease_until and updated_at change, neither is indexed, and the table's fillfactor leaves
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
-- The fence of a completion, or of a group of them written together (completions.py): $1
-- tasks, $2 owners, $3 lease attempts, one element per task, $4 now. Run inside the caller's
-- transaction: the row lock taken here is held until commit, so the sink's writes that
-- follow in the same transaction cannot race a takeover. Each task's fence on its own:
-- the tasks that come back are completed and their rows locked until commit; a task that
-- does not is fenced out and nothing else of it is written.
--
-- The one lock order of task rows (docs/architecture.md#index-generations): (tenant_id in
-- byte order, document_id, version_number, task_id), the order a group writes its tasks in
-- (completions.py sorts a group so; a group holds one task per document), and every row
-- before any tenant_search_generation row (the sink's lock_completion_generation comes
-- after). `kb index generations retire` locks the tasks it ends in the same order and
-- before the tenant rows (generations/generations.sql: lock_unfinished_tasks), so a retire
-- meeting a committing backfill waits for it instead of deadlocking. FOR UPDATE locks the
-- rows as they leave the sort (the plan's LockRows node sits above it); a row changed
-- while we waited is checked again and left out when its fence no longer holds.
WITH fenced AS (
    SELECT t.task_id
      FROM index_task t
      JOIN unnest($1::uuid[], $2::text[], $3::integer[]) AS f (task_id, owner, attempts)
        ON t.task_id = f.task_id
     WHERE t.status = 'RUNNING'
       AND t.lease_owner = f.owner
       AND t.attempts = f.attempts
       AND t.lease_until > coalesce($4::timestamptz, now())
     ORDER BY t.tenant_id COLLATE "C", t.document_id, t.version_number, t.task_id
       FOR UPDATE OF t
)
UPDATE index_task t
   SET status = 'SUCCEEDED',
       lease_until = NULL,
       error_code = NULL,
       error_message = NULL,
       updated_at = coalesce($4::timestamptz, now()),
       finished_at = coalesce($4::timestamptz, now())
  FROM fenced f
 WHERE t.task_id = f.task_id
RETURNING t.task_id

-- name: renew_held_leases
-- $1 tasks, $2 owners, $3 lease attempts, one element per task of a completion group; $4
-- the tasks whose fence held in the group's transaction that just rolled back; $5 now.
-- Run first in the transaction that writes the group again task by task (completions.py):
-- the tasks that come back are the rows it now holds.
--
-- While the group's transaction held a fenced task's row, the heartbeat left its lease
-- alone (a beat would only have waited for the lock), so a long group may have outlived
-- it; without this the fallback's own fence (complete_task: an unexpired lease) would
-- refuse every such task and it would be done again. Renewing them needs no unexpired
-- lease: no takeover could come while our transaction held the row, and one since it
-- ended bumps `attempts` (claim_tasks), which this fence checks -- RUNNING under our owner
-- and generation means no one else has had the task. A task whose fence did not hold
-- ($4) is locked but not renewed: its lease, expired or not, is for its own fence to
-- judge. A lease is renewed from now for as long as it was last granted (the claim and the
-- heartbeat set lease_until and updated_at together), never shortened.
--
-- Locks: every row of the group still ours, in the one lock order of task rows
-- (complete_task), before the fallback's fences relock them one by one in that order: the
-- fallback takes its task rows in that order too, and never a row after a pointer or an
-- outbox lock. The rows stay locked until the fallback ends, its savepoints' rollbacks
-- included, so no takeover can come before its fences run.
WITH mine AS (
    SELECT t.task_id, t.task_id = ANY($4::uuid[]) AS held
      FROM index_task t
      JOIN unnest($1::uuid[], $2::text[], $3::integer[]) AS f (task_id, owner, attempts)
        ON t.task_id = f.task_id
     WHERE t.status = 'RUNNING'
       AND t.lease_owner = f.owner
       AND t.attempts = f.attempts
     ORDER BY t.tenant_id COLLATE "C", t.document_id, t.version_number, t.task_id
       FOR UPDATE OF t
)
UPDATE index_task t
   SET lease_until = CASE WHEN m.held
                          THEN greatest(t.lease_until, coalesce($5::timestamptz, now())
                                                       + (t.lease_until - t.updated_at))
                          ELSE t.lease_until END,
       updated_at = CASE WHEN m.held THEN coalesce($5::timestamptz, now())
                         ELSE t.updated_at END
  FROM mine m
 WHERE t.task_id = m.task_id
RETURNING t.task_id

-- name: fail_task
-- $1 task, $2 owner, $3 lease generation: the fence. $4 RETRY_WAIT or DEAD as the retry
-- policy decided from the error code, $5 delay seconds, $6 code, $7 message, $8 now,
-- $9 whether $6 is a provider-side code (PROVIDER_FAILURE_CODES), $10 the provider failure
-- time budget in seconds (NULL: the decision is not on it), $11 the message if it is spent.
--
-- The settling of task.py's `settle`: a provider-side code records the task's first such
-- failure (first_provider_failure_at, kept if set). On the time budget ($10), a task whose
-- budget has run out (now >= first + budget) goes DEAD with $11; otherwise RETRY_WAIT, due
-- no later than the budget's end, and max_attempts + 1: a provider failure spends none of
-- the attempt budget (`attempts`, the generation, grows by the claim as always).
--
-- `target` locks the fenced row (FOR UPDATE: under READ COMMITTED a concurrent change is
-- waited for and its result re-read), so what is computed from it is the row updated.
-- A task that ends DEAD takes its staged chunks (knowledge_chunk_stream, every attempt's)
-- with it, in this statement: no later attempt will run to delete them. This statement sees
-- all of them: this attempt wrote its slices one after another and has stopped, and an
-- earlier attempt's last slice committed before our claim could take the row
-- (sink.sql: lock_stream_lease). A RETRY_WAIT keeps them for the next attempt to delete.
-- A DEAD row comes back with `command_id`, the ingest command that created its task (as
-- sink.sql's switch_search_version finds it): its caller writes DocumentIndexingFailed
-- in this statement's transaction (failed.py).
WITH target AS (
    SELECT t.task_id, n.at,
           CASE WHEN $9::boolean THEN coalesce(t.first_provider_failure_at, n.at)
                ELSE t.first_provider_failure_at END AS first_failure
      FROM index_task t
     CROSS JOIN (SELECT coalesce($8::timestamptz, now()) AS at) n
     WHERE t.task_id = $1
       AND t.status = 'RUNNING'
       AND t.lease_owner = $2
       AND t.attempts = $3
       AND t.lease_until > n.at
       AND $4::text IN ('RETRY_WAIT', 'DEAD')
       FOR UPDATE OF t
),
decided AS (
    SELECT g.task_id, g.at, g.first_failure,
           g.first_failure + make_interval(secs => $10::double precision) AS budget_end,
           coalesce(g.first_failure + make_interval(secs => $10::double precision) <= g.at,
                    false) AS spent
      FROM target g
),
failed AS (
    UPDATE index_task t
       SET status = CASE WHEN d.spent THEN 'DEAD' ELSE $4::text END,
           max_attempts = t.max_attempts
                          + CASE WHEN $10::double precision IS NOT NULL AND NOT d.spent
                                 THEN 1 ELSE 0 END,
           lease_until = NULL,
           next_attempt_at = CASE WHEN d.spent THEN d.at
                                  ELSE least(d.at + make_interval(secs => $5), d.budget_end)
                             END,
           error_code = $6,
           error_message = CASE WHEN d.spent THEN $11::text ELSE $7::text END,
           first_provider_failure_at = d.first_failure,
           updated_at = d.at,
           finished_at = CASE WHEN d.spent OR $4::text = 'DEAD' THEN d.at END
      FROM decided d
     WHERE t.task_id = d.task_id
    RETURNING t.*
),
unstaged AS (
    DELETE FROM knowledge_chunk_stream s
     USING failed f
     WHERE f.status = 'DEAD' AND s.task_id = f.task_id
)
SELECT f.*,
       CASE WHEN f.status = 'DEAD' THEN
            (SELECT c.command_id
               FROM ingest_command AS c
              WHERE c.tenant_id = f.tenant_id AND c.task_id = f.task_id
              ORDER BY c.applied_at, c.command_id
              LIMIT 1) END AS command_id
  FROM failed f

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
-- $1 task, $2 the status it requeues from, $3 who, $4 reset the budget?, $5 budget,
-- $6 reason code and $7 reason message for the audit (NULL: the task's own error), $8 now.
-- The one way a finished task goes back to PENDING: from DEAD (`kb tasks requeue`, the
-- operator page: PgTaskQueue.requeue) or from SUCCEEDED (`kb index check --repair`
-- re-running a drifted version: PgTaskQueue.rerun_succeeded). A task in any other status,
-- or in another status than $2, is left as it is and no audit row is written; the caller
-- tells the two apart by reading the task.
--
-- The row lock makes two concurrent requeues of one task produce one audit row (the
-- second finds the task no longer in $2 after the lock wait and requeues nothing).
-- `attempts` is kept: it is the fencing generation and must never repeat; the budget
-- moves via max_attempts (a reset grants $5 more attempts, otherwise exactly one).
-- The provider failure time budget starts afresh (first_provider_failure_at NULL).
-- lease_owner: a re-run SUCCEEDED task forgets the worker that completed it; a requeued
-- DEAD task keeps its last owner until the next claim replaces it (each as its caller did
-- when they were two queries).
WITH target AS (
    SELECT task_id, status, attempts, max_attempts, error_code, error_message
      FROM index_task
     WHERE task_id = $1 AND status = $2::text AND $2::text IN ('DEAD', 'SUCCEEDED')
       FOR UPDATE
),
requeued AS (
    UPDATE index_task t
       SET status = 'PENDING',
           max_attempts = g.attempts + CASE WHEN $4::boolean THEN $5::integer ELSE 1 END,
           lease_owner = CASE WHEN g.status = 'SUCCEEDED' THEN NULL ELSE t.lease_owner END,
           lease_until = NULL,
           next_attempt_at = coalesce($8::timestamptz, now()),
           error_code = NULL,
           error_message = NULL,
           first_provider_failure_at = NULL,
           updated_at = coalesce($8::timestamptz, now()),
           finished_at = NULL
      FROM target g
     WHERE t.task_id = g.task_id
    RETURNING t.task_id, t.max_attempts
)
INSERT INTO index_task_requeue (task_id, requeued_by, requeued_at, reset_attempts, attempts,
                                previous_max_attempts, new_max_attempts, previous_error_code,
                                previous_error_message)
SELECT g.task_id, $3, coalesce($8::timestamptz, now()), $4::boolean, g.attempts,
       g.max_attempts, r.max_attempts,
       CASE WHEN $6::text IS NULL THEN g.error_code ELSE $6::text END,
       CASE WHEN $6::text IS NULL THEN g.error_message ELSE $7::text END
  FROM target g
  JOIN requeued r ON r.task_id = g.task_id
RETURNING *

-- name: requeue_history
SELECT *
  FROM index_task_requeue
 WHERE task_id = $1
 ORDER BY requeue_id
