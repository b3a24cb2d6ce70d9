-- The fault driver's reads of the task rows (kbtools/chaos/rig/faults.py).

-- name: worker_holds_running_task
-- $1 a worker's pid: does it hold a running task? A lease owner is <host>:<pid>:<random>.
SELECT EXISTS (SELECT 1 FROM index_task
                WHERE status = 'RUNNING' AND lease_owner LIKE '%:' || $1::text || ':%')

-- name: held_tasks
-- $1 a lease owner pattern, $2 the tasks it held at the last look. Through the running
-- tasks' partial index, then the primary key: polled every few milliseconds.
SELECT task_id::text, status, lease_owner LIKE $1 AS mine
  FROM index_task
 WHERE (status = 'RUNNING' AND lease_owner LIKE $1)
    OR task_id = ANY($2::uuid[])
