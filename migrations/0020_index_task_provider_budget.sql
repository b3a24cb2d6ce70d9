-- Provider-side failures (EMBEDDING_RATE_LIMITED, _TIMEOUT, _UNAVAILABLE, _RESPONSE_MALFORMED)
-- follow a time budget instead of the attempt count (docs/architecture.md#retries-and-failure-codes):
-- a task retries them until KB_INDEXER_PROVIDER_FAILURE_BUDGET_SECONDS (default 24 h) after
-- the first one, then ends DEAD. This column is when that first one was recorded: set by the
-- fenced fail (coalesce(existing, now)), cleared by a requeue, NULL for a task that never
-- met one.
--
-- A nullable column without a default: a change to the catalog only, no table rewrite. It is
-- in no index and the heartbeat does not write it, so heartbeats stay HOT updates.
ALTER TABLE index_task ADD COLUMN first_provider_failure_at timestamptz;
