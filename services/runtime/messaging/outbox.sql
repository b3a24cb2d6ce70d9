-- name: insert_event
-- One document's events commit in the order of their positions, whatever the caller locks:
-- the transaction-scoped advisory lock on the aggregate key (taken in the FROM clause,
-- before the row and its position exist) makes a second writer of the same key wait until
-- the first commits or rolls back, so it takes its position after the first one's commit.
-- EXPLAIN VERBOSE shows it: the identity's nextval is in the Subquery Scan's output, computed
-- from the row `serialised` yields once the lock is granted (its volatile call keeps it from
-- being pulled up). A waiting writer has no position yet, so none can fall between another
-- writer's events of the same key.
-- The relay sends a window in position order, hence per key in commit order. Seed
-- 4_206_902_611 keeps these locks apart from other advisory locks on the same text. Held
-- to the end of the caller's transaction: producers add their events last.
-- txid defaults to pg_current_xact_id(): the relay orders and windows rows by it.
-- $7: the writer's W3C traceparent (migration 0034), NULL when it does not trace.
INSERT INTO outbox (event_id, event_type, tenant_id, tier, aggregate_key, payload, traceparent)
SELECT $1, $2, $3, $4, $5, $6, $7
  FROM (SELECT pg_advisory_xact_lock(hashtextextended($5::text, 4206902611))) AS serialised
RETURNING position, event_id

-- name: insert_events
-- $1 event ids, $2 types, $3 tenants, $4 tiers, $5 aggregate keys, $6 payloads, $7
-- traceparents, $8 whether to lock the keys. Positions in the order given.
-- $8 true: insert_event's per-key lock for every key among $5, taken in key order (the
-- volatile call in the target list is evaluated after the sort) before any event gets a
-- position: `serialised` is read by a one-time filter, which the executor evaluates before
-- the first row (and its identity's nextval), so positions still follow commits per key --
-- in one round trip, not a statement for the locks and another for the rows.
-- $8 false: no lock, for aggregates created in the caller's transaction (outbox.py:
-- add_events_of_new_aggregates).
WITH serialised AS (
    SELECT pg_advisory_xact_lock(hashtextextended(k, 4206902611))
      FROM (SELECT DISTINCT k FROM unnest($5::text[]) AS k WHERE $8::boolean) AS keys
     ORDER BY k
)
INSERT INTO outbox (event_id, event_type, tenant_id, tier, aggregate_key, payload, traceparent)
SELECT event_id, event_type, tenant_id, tier, aggregate_key, payload, traceparent
  FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[], $6::bytea[],
              $7::text[])
       WITH ORDINALITY AS e (event_id, event_type, tenant_id, tier, aggregate_key, payload,
                             traceparent, n)
 WHERE (SELECT count(*) FROM serialised) >= 0
 ORDER BY n
RETURNING position, event_id
