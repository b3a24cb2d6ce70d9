-- name: insert_event
-- txid defaults to pg_current_xact_id(): the relay orders and windows rows by it.
INSERT INTO outbox (event_id, event_type, tenant_id, tier, aggregate_key, payload)
VALUES ($1, $2, $3, $4, $5, $6)
RETURNING position, event_id
