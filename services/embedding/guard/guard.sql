-- The embedding provider's shared guard (services/embedding/guard/store_pg.py, migration
-- 0019). Every time-dependent query takes `now` as a parameter: NULL means the database
-- clock (one clock for every process), a value is a test's injected time.
--
-- Locking, the one rule that keeps concurrent guards from deadlocking: a transaction locks
-- rows in key order, (provider) before (provider, bucket), and buckets in `bucket` order:
-- - a reservation locks only its buckets (lock_buckets), never the provider's row;
-- - a pause locks the provider's row (lock_provider), then all its buckets (lock_all_buckets);
-- - a breaker transition locks the provider's row alone.
-- Rows are created beforehand, outside these transactions (ensure_*): an insert inside one
-- would hold a new key out of order while it waits for the next lock.
-- Nothing else runs inside these transactions: no network, no sleeping. The caller sleeps
-- until its send time after the commit.

-- name: provider_states
-- $1 now. Every provider's row with `now`: each column a ProviderView is read from
-- (store_pg.py). view_provider, lock_provider and list_providers include it, so that the
-- three read the row alike.
SELECT provider,
       coalesce($1::timestamptz, statement_timestamp()) AS now,
       paused_until,
       breaker_state,
       consecutive_failures,
       opened_at,
       open_until,
       probe_owner,
       probe_until,
       last_failure_code,
       last_success_at,
       updated_at
  FROM embedding_provider_state;

-- name: view_provider
-- $1 now, $2 provider. One row even for a provider never seen (its columns NULL, `now` not:
-- the right join keeps the provider asked for).
-- include: provider_states
 RIGHT JOIN (SELECT $2::text AS provider) AS asked USING (provider);

-- name: ensure_provider
-- $1 provider, $2 now. Autocommitted, or first in a transaction that locks nothing before.
INSERT INTO embedding_provider_state (provider, updated_at)
VALUES ($1, coalesce($2::timestamptz, statement_timestamp()))
ON CONFLICT (provider) DO NOTHING;

-- name: ensure_buckets
-- $1 provider, $2 bucket names, $3 now. Autocommitted (see the locking rule above). A new
-- bucket owes nothing: its tat is now.
INSERT INTO embedding_quota_bucket (provider, bucket, tat)
SELECT $1, wanted.bucket, coalesce($3::timestamptz, statement_timestamp())
  FROM unnest($2::text[]) AS wanted(bucket)
 ORDER BY wanted.bucket
ON CONFLICT (provider, bucket) DO NOTHING;

-- name: lock_provider
-- $1 now, $2 provider. The row, locked until the transaction ends. `now` is read as the
-- statement starts: a wait for the lock makes it that much early, which no breaker
-- decision is sensitive to (milliseconds against seconds).
-- include: provider_states
 WHERE provider = $2
   FOR UPDATE;

-- name: lock_buckets
-- $1 provider, $2 bucket names. LockRows runs above the sort: the rows are locked in
-- `bucket` order, the same in every transaction, so two reservations wait for each other
-- and never deadlock.
SELECT bucket, tat
  FROM embedding_quota_bucket
 WHERE provider = $1
   AND bucket = ANY ($2::text[])
 ORDER BY bucket
   FOR UPDATE;

-- name: lock_all_buckets
-- $1 provider. Every bucket of the provider, in `bucket` order (a pause moves them all).
SELECT bucket, tat
  FROM embedding_quota_bucket
 WHERE provider = $1
 ORDER BY bucket
   FOR UPDATE;

-- name: read_pause
-- $1 provider, $2 now. Run after lock_buckets, in a statement of its own: READ COMMITTED
-- gives it a snapshot taken once the locks are held, so it sees a pause committed while
-- the reservation waited (a pause holds the buckets' locks until it commits), and `now`
-- excludes the wait.
SELECT coalesce($2::timestamptz, statement_timestamp()) AS now,
       (SELECT paused_until FROM embedding_provider_state WHERE provider = $1) AS paused_until;

-- name: write_buckets
-- $1 provider, $2 bucket names, $3 their new tats. The rows are locked by this transaction.
UPDATE embedding_quota_bucket AS bucket
   SET tat = owed.tat
  FROM unnest($2::text[], $3::timestamptz[]) AS owed(name, tat)
 WHERE bucket.provider = $1
   AND bucket.bucket = owed.name;

-- name: write_pause
-- $1 provider, $2 paused until, $3 now. The row is locked by this transaction.
UPDATE embedding_provider_state
   SET paused_until = $2,
       updated_at = coalesce($3::timestamptz, statement_timestamp())
 WHERE provider = $1;

-- name: write_breaker
-- $1 provider, $2 state, $3 consecutive failures, $4 opened at, $5 open until, $6 probe
-- owner, $7 probe until, $8 last failure code, $9 last success at, $10 now. The row is
-- locked by this transaction.
UPDATE embedding_provider_state
   SET breaker_state = $2,
       consecutive_failures = $3,
       opened_at = $4,
       open_until = $5,
       probe_owner = $6,
       probe_until = $7,
       last_failure_code = $8,
       last_success_at = $9,
       updated_at = coalesce($10::timestamptz, statement_timestamp())
 WHERE provider = $1;

-- name: list_providers
-- $1 now. Every provider any process has used, for the operator page and `kb tasks list`.
-- include: provider_states
 ORDER BY provider;
