-- Relay queries. The technique (PgQ's snapshot-difference batches) is explained at the top
-- of services/relay/outbox_pg.py; the short version sits with each query.

-- name: insert_partitions
-- $1 partition count. Idempotent: a second relay (or a restart) inserts nothing.
INSERT INTO relay_partition (partition, partition_count)
SELECT p, $1::integer FROM generate_series(0, $1::integer - 1) AS p
ON CONFLICT (partition) DO NOTHING

-- name: partition_layout
-- What the table says the partitioning is; a relay configured otherwise refuses to start
-- (rows would silently change partitions, and their progress would not follow them).
SELECT count(*)::integer AS partitions,
       min(partition_count) AS min_count,
       max(partition_count) AS max_count
  FROM relay_partition

-- name: acquire_leases
-- $1 owner, $2 how many at most, $3 lease seconds, $4 now (NULL = database clock).
-- Takes partitions nobody holds or whose lease ran out. FOR UPDATE SKIP LOCKED plus the
-- re-check PostgreSQL makes on a locked row that changed since the statement's snapshot
-- means two relays racing for one partition cannot both win: the loser either skips the
-- locked row or re-evaluates the WHERE against the winner's new lease_until and drops it.
-- Every acquisition bumps the epoch: the fence for everything the new holder writes.
-- Progress made on another cluster (or ahead of this one's transaction counter) is never
-- driven: relay_partition_refusal (migrations/0005) keeps such a partition out, the relay
-- reports it (refused_partitions) until an operator re-seeds it. A partition without a
-- recorded cluster yet records this one.
WITH free AS (
    SELECT partition
      FROM relay_partition
     WHERE (owner IS NULL OR lease_until <= coalesce($4::timestamptz, now()))
       AND relay_partition_refusal(cluster_id, delivered_snapshot, window_snapshot) IS NULL
     ORDER BY partition
     LIMIT $2
       FOR UPDATE SKIP LOCKED
)
UPDATE relay_partition AS p
   SET owner = $1,
       epoch = p.epoch + 1,
       cluster_id = relay_cluster_id(),
       lease_until = coalesce($4::timestamptz, now()) + make_interval(secs => $3::float8)
  FROM free
 WHERE p.partition = free.partition
RETURNING p.partition, p.partition_count, p.epoch,
          p.delivered_snapshot::text AS delivered_snapshot,
          p.window_snapshot::text AS window_snapshot,
          p.window_position, p.window_end, p.window_start

-- name: renew_lease
-- $1 partition, $2 owner, $3 epoch, $4 lease seconds, $5 now. No row back = lease lost.
UPDATE relay_partition
   SET lease_until = coalesce($5::timestamptz, now()) + make_interval(secs => $4::float8)
 WHERE partition = $1 AND owner = $2 AND epoch = $3
   AND lease_until > coalesce($5::timestamptz, now())
RETURNING partition

-- name: commit_progress
-- $1 partition, $2 owner, $3 epoch, $4 delivered snapshot, $5 window snapshot (or NULL),
-- $6 window position, $7 lease seconds, $8 now, $9 window end, $10 window start. Fenced
-- like renew_lease: a
-- relay whose lease ran out (or was taken over, epoch + 1) moves nothing. Renews the
-- lease too. Guarded against a change of cluster under a running relay (its connections
-- now reach another cluster): progress is only written on the cluster that recorded it,
-- and delivered never moves backwards (PgLeaseStore tells a refusal from a lost lease).
UPDATE relay_partition
   SET delivered_snapshot = $4::text::pg_snapshot,
       window_snapshot = $5::text::pg_snapshot,
       window_position = $6,
       window_end = $9,
       window_start = $10,
       progressed_at = coalesce($8::timestamptz, now()),
       lease_until = coalesce($8::timestamptz, now()) + make_interval(secs => $7::float8)
 WHERE partition = $1 AND owner = $2 AND epoch = $3
   AND lease_until > coalesce($8::timestamptz, now())
   AND cluster_id = relay_cluster_id()
   AND pg_snapshot_xmax($4::text::pg_snapshot) >= pg_snapshot_xmax(delivered_snapshot)
RETURNING partition

-- name: release_lease
-- $1 partition, $2 owner, $3 epoch, $4 delivered snapshot, $5 window snapshot, $6 window
-- position, $7 now, $8 window end, $9 window start. A clean shutdown records where it stands (an idle partition's progress
-- lives in memory between lease renewals) and hands the partition over at once. Fenced.
UPDATE relay_partition
   SET owner = NULL, lease_until = NULL,
       delivered_snapshot = $4::text::pg_snapshot,
       window_snapshot = $5::text::pg_snapshot,
       window_position = $6,
       window_end = $8,
       window_start = $9
 WHERE partition = $1 AND owner = $2 AND epoch = $3
   AND lease_until > coalesce($7::timestamptz, now())
   AND cluster_id = relay_cluster_id()
   AND pg_snapshot_xmax($4::text::pg_snapshot) >= pg_snapshot_xmax(delivered_snapshot)
RETURNING partition

-- name: live_owners
-- $1 now. The relay instances holding a lease that has not run out.
SELECT DISTINCT owner
  FROM relay_partition
 WHERE owner IS NOT NULL AND lease_until > coalesce($1::timestamptz, now())
 ORDER BY owner

-- name: try_retention_lock
-- Session-level advisory lock on the retention connection: whichever relay instance gets
-- it deletes, the others skip this round (no instance is special, none waits).
SELECT pg_try_advisory_lock(hashtextextended('kb.relay.retention', 0)) AS locked

-- name: retention_unlock
SELECT pg_advisory_unlock(hashtextextended('kb.relay.retention', 0)) AS unlocked

-- name: arm_doorbell
-- A relay is about to wait for rows: writers notify from now on (migrations/0008). A
-- no-op (no row locked) while it is armed already.
UPDATE relay_doorbell SET armed = true WHERE NOT armed

-- name: disarm_doorbell
-- A notification woke the relays: writers stop notifying until one waits again.
UPDATE relay_doorbell SET armed = false WHERE armed

-- name: partition_refusal
-- $1 partition. Why its stored progress cannot be trusted on this cluster (NULL: it can).
SELECT relay_partition_refusal(cluster_id, delivered_snapshot, window_snapshot) AS reason
  FROM relay_partition
 WHERE partition = $1

-- name: refused_partitions
-- Partitions no relay may drive on this cluster, and why (see acquire_leases).
SELECT partition, relay_partition_refusal(cluster_id, delivered_snapshot, window_snapshot) AS reason
  FROM relay_partition
 WHERE relay_partition_refusal(cluster_id, delivered_snapshot, window_snapshot) IS NOT NULL
 ORDER BY partition

-- name: open_window
-- $1 partition count, $2 partition, $3 delivered snapshot, $4 its in-progress txids
-- (pg_snapshot_xip($3), passed as text[]: an index probe, not a subquery), $5 limit, $6 how many
-- positions the first read may cover.
-- Opens the next window at this statement's own snapshot (pg_current_snapshot() is the
-- statement's snapshot, so what it reads and what it records are the same), finds the
-- window's position range, and reads its first rows, all in one round trip. The window is
-- every row whose txid is visible in the new snapshot but not in the delivered one; "not
-- visible in delivered" is exactly "txid in its in-progress list, or txid >= its xmax",
-- which makes both halves index probes/ranges on outbox_txid however old the oldest open
-- transaction is: a long-open transaction only adds its own txid to the list, it does not
-- widen the scan. window_start is the lowest position of the second half (transactions
-- that began after the delivered snapshot, so their positions come after every delivered
-- row); below it the window holds only late committers' rows (first half), read by txid
-- (see migrations/0008). Always at least one row back (NULL event columns when there is
-- nothing).
WITH w AS MATERIALIZED (
    SELECT pg_current_snapshot() AS upto
), late AS MATERIALIZED (
    -- Late committers: one outbox_txid probe per transaction open at the delivered snapshot
    -- (an aggregate per probe: the planner cannot turn it into a scan of the whole table).
    SELECT r.low, r.high
      FROM unnest($4::text[]::xid8[]) AS t(txid)
     CROSS JOIN w
     CROSS JOIN LATERAL (
            SELECT min(o.position) AS low, max(o.position) AS high
              FROM outbox AS o
             WHERE o.txid = t.txid
               AND pg_visible_in_snapshot(o.txid, w.upto)
               AND (hashtext(o.aggregate_key) & 2147483647) % $1::integer = $2::integer
           ) AS r
), fresh AS MATERIALIZED (
    -- Transactions that began after the delivered snapshot: one outbox_txid range.
    SELECT o.position
      FROM w
      JOIN outbox AS o
        ON o.txid >= pg_snapshot_xmax($3::text::pg_snapshot)
       AND o.txid < pg_snapshot_xmax(w.upto)
     WHERE pg_visible_in_snapshot(o.txid, w.upto)
       AND (hashtext(o.aggregate_key) & 2147483647) % $1::integer = $2::integer
), bounds AS MATERIALIZED (
    SELECT least(l.low, f.low) AS first_position,
           greatest(l.high, f.high) AS last_position,
           coalesce(f.low, l.high + 1) AS window_start
      FROM (SELECT min(low) AS low, max(high) AS high FROM late) AS l,
           (SELECT min(position) AS low, max(position) AS high FROM fresh) AS f
)
-- search_token (the header of DocumentSearchVersionSwitched, docs/scaling.md#read-your-switch):
-- the WAL insert position, read after the rows' transactions committed (they are visible
-- to this statement), so at or past their commit records.
SELECT w.upto::text AS window_snapshot, b.first_position, b.last_position, b.window_start,
       r.position, r.event_id, r.event_type, r.tenant_id, r.tier, r.aggregate_key,
       r.payload, r.created_at, r.traceparent, pg_current_wal_insert_lsn()::text AS search_token
  FROM w
 CROSS JOIN bounds AS b
  LEFT JOIN LATERAL (
        (SELECT o.position, o.event_id, o.event_type, o.tenant_id, o.tier, o.aggregate_key,
                o.payload, o.created_at, o.traceparent
           FROM unnest($4::text[]::xid8[]) AS late(txid)
          CROSS JOIN LATERAL (
                SELECT *
                  FROM outbox AS o
                 WHERE (o.txid, o.position) > (late.txid, 0)
                   AND (o.txid, o.position) < (late.txid, b.window_start)
                   AND pg_visible_in_snapshot(o.txid, w.upto)
                   AND (hashtext(o.aggregate_key) & 2147483647) % $1::integer = $2::integer
                 ORDER BY o.txid, o.position
                 LIMIT $5) AS o
          ORDER BY o.position
          LIMIT $5)
        UNION ALL
        (SELECT o.position, o.event_id, o.event_type, o.tenant_id, o.tier, o.aggregate_key,
                o.payload, o.created_at, o.traceparent
           FROM outbox AS o
          WHERE o.position >= b.window_start
            AND o.position <= least(b.last_position, b.window_start - 1 + $6::bigint)
            AND pg_visible_in_snapshot(o.txid, w.upto)
            AND NOT pg_visible_in_snapshot(o.txid, $3::text::pg_snapshot)
            AND (hashtext(o.aggregate_key) & 2147483647) % $1::integer = $2::integer
          ORDER BY o.position
          LIMIT $5)
        ORDER BY position
        LIMIT $5
       ) AS r ON true
 ORDER BY r.position

-- name: read_window_batch
-- $1 partition count, $2 partition, $3 delivered snapshot, $4 window snapshot, $5 after
-- position, $6 up to position (inclusive), $7 limit, $8 the delivered snapshot's
-- in-progress txids (text[]), $9 window start.
-- The next rows of the open window in position order. Below window_start only late
-- committers' rows belong to the window: they are found by txid, one outbox_txid range
-- per late transaction read in position order, so the delivered rows between them are
-- never read. From window_start on, rows are read from a
-- bounded position range (a primary-key range: the cost of a read is bounded by the
-- range, whatever plan is chosen, never by the size of the window or the table). Rows go
-- out in position order inside a window, which for one aggregate key is commit order:
-- add_event (services/runtime/messaging/outbox.sql) makes a key's writers wait for each other, so a
-- later commit takes a higher position. This statement's snapshot is newer than the
-- window's, so it sees every row the window snapshot does.
-- search_token: as open_window's.
(SELECT o.position, o.event_id, o.event_type, o.tenant_id, o.tier, o.aggregate_key,
        o.payload, o.created_at, o.traceparent, pg_current_wal_insert_lsn()::text AS search_token
   FROM unnest($8::text[]::xid8[]) AS late(txid)
  CROSS JOIN LATERAL (
        -- txid = late.txid and $5 < position < $9, written as a range of outbox_txid's
        -- (txid, position): only that index can serve it (an equality on txid would let
        -- the planner walk the primary key over the whole gap instead).
        SELECT *
          FROM outbox AS o
         WHERE (o.txid, o.position) > (late.txid, $5)
           AND (o.txid, o.position) < (late.txid, $9)
           AND pg_visible_in_snapshot(o.txid, $4::text::pg_snapshot)
           AND (hashtext(o.aggregate_key) & 2147483647) % $1::integer = $2::integer
         ORDER BY o.txid, o.position
         LIMIT $7) AS o
  ORDER BY o.position
  LIMIT $7)
UNION ALL
(SELECT o.position, o.event_id, o.event_type, o.tenant_id, o.tier, o.aggregate_key,
        o.payload, o.created_at, o.traceparent, pg_current_wal_insert_lsn()::text AS search_token
   FROM outbox AS o
  WHERE o.position > greatest($5, $9 - 1) AND o.position <= $6
    AND pg_visible_in_snapshot(o.txid, $4::text::pg_snapshot)
    AND NOT pg_visible_in_snapshot(o.txid, $3::text::pg_snapshot)
    AND (hashtext(o.aggregate_key) & 2147483647) % $1::integer = $2::integer
  ORDER BY o.position
  LIMIT $7)
ORDER BY position
LIMIT $7

-- name: backlog_floor
-- The oldest txid any partition may still owe: below every delivered snapshot's xmin all
-- transactions had finished (and were delivered). Passed to backlog as a constant.
-- Refused partitions (progress from another cluster) are left out here and in backlog:
-- their snapshots mean nothing on this cluster; backlog reports them apart.
SELECT min(pg_snapshot_xmin(delivered_snapshot)) FILTER (WHERE NOT refused)::text AS floor,
       count(*) FILTER (WHERE refused)::integer AS refused
  FROM (SELECT delivered_snapshot,
               relay_partition_refusal(cluster_id, delivered_snapshot, window_snapshot)
                   IS NOT NULL AS refused
          FROM relay_partition) AS p

-- name: backlog
-- $1 now, $2 backlog_floor. Committed rows no relay has had acknowledged yet, and the
-- oldest one's age: not visible in their partition's delivered snapshot, and not among the
-- part of the current window already sent. The floor makes it an index range scan over
-- the recent end of the outbox, not a scan of everything retained.
SELECT count(o.position)::bigint AS backlog_rows,
       coalesce(extract(epoch FROM coalesce($1::timestamptz, now()) - min(o.created_at)),
                0)::float8 AS oldest_age_s
  FROM outbox AS o
  JOIN relay_partition AS p
    ON (hashtext(o.aggregate_key) & 2147483647) % p.partition_count = p.partition
 WHERE o.txid >= $2::text::xid8
   AND relay_partition_refusal(p.cluster_id, p.delivered_snapshot, p.window_snapshot) IS NULL
   AND NOT pg_visible_in_snapshot(o.txid, p.delivered_snapshot)
   AND NOT (p.window_snapshot IS NOT NULL
            AND o.position <= p.window_position
            AND pg_visible_in_snapshot(o.txid, p.window_snapshot))

-- name: retention_cutoff
-- $1 now, $2 retention seconds. Rows created before this instant may go.
SELECT coalesce($1::timestamptz, now()) - make_interval(secs => $2::float8)

-- name: retention_range
-- $1 cutoff. Positions of the rows old enough to go (delivered or not; delete_delivered
-- keeps the undelivered ones).
SELECT min(position) AS low, max(position) AS high
  FROM outbox
 WHERE created_at < $1

-- name: delete_delivered
-- $1 from position (inclusive), $2 to position (exclusive), $3 cutoff. One bounded range
-- per statement and transaction: row locks only, no table lock, so replays and the live
-- relay (which read under MVCC) are never blocked. A row is delivered once its txid is
-- visible in its own partition's delivered snapshot (the definition of that snapshot,
-- migrations/0004). Not "below every delivered snapshot's xmin": that would keep every
-- row younger than the oldest transaction open anywhere on the cluster, any database's,
-- for as long as it stays open. Nothing goes while a partition's progress is refused
-- (from another cluster): its snapshot says nothing about what was delivered.
DELETE FROM outbox AS o
 USING relay_partition AS p
 WHERE o.position >= $1 AND o.position < $2
   AND o.created_at < $3
   AND p.partition = (hashtext(o.aggregate_key) & 2147483647) % p.partition_count
   AND pg_visible_in_snapshot(o.txid, p.delivered_snapshot)
   AND NOT EXISTS (
        SELECT 1 FROM relay_partition
         WHERE relay_partition_refusal(cluster_id, delivered_snapshot, window_snapshot)
               IS NOT NULL)

-- name: replay_last_position
SELECT coalesce(max(position), 0)::bigint AS last_position FROM outbox

-- name: replay_rows
-- $1 after position, $2 up to position (inclusive), $3 since, $4 until (exclusive),
-- $5 tenant, $6 tier, $7 event type (each of the last five optional): the rows a replay
-- re-sends. Reads only, so live delivery and its progress are untouched.
-- search_token: as open_window's, read at the replay (later, so still past the commit).
SELECT position, event_id, event_type, tenant_id, tier, aggregate_key, payload, created_at,
       traceparent, pg_current_wal_insert_lsn()::text AS search_token
  FROM outbox
 WHERE position > $1 AND position <= $2
   AND ($3::timestamptz IS NULL OR created_at >= $3::timestamptz)
   AND ($4::timestamptz IS NULL OR created_at < $4::timestamptz)
   AND ($5::text IS NULL OR tenant_id = $5::text)
   AND ($6::text IS NULL OR tier = $6::text)
   AND ($7::text IS NULL OR event_type = $7::text)

-- name: replay_batch
-- replay_rows, $8 limit: keyset pages in position order.
-- include: replay_rows
 ORDER BY position
 LIMIT $8

-- name: replay_count
-- How many rows replay_rows holds, for the replay progress gauge.
SELECT count(*)::bigint AS total
  FROM (
        -- include: replay_rows
       ) AS r

-- name: known_tiers
SELECT DISTINCT tier FROM tenant ORDER BY tier
