-- One document's path as one trace (issue 46, docs/operations.md#tracing): the W3C
-- traceparent of the publish that wrote a row, kept with the outbox row (the relay sends it
-- as a Kafka header) and with the index task (an attempt claimed by a poll, with no Kafka
-- message, still continues the publish's trace). NULL when the writer was not tracing.
--
-- Nullable columns without a default: a catalog change, no rewrite; the lock is brief but
-- waits behind a long transaction on the table, hence the timeout.
SET LOCAL lock_timeout = '10s';

-- 55 characters for version 00 (2 + 32 + 16 + 2 hex digits and 3 dashes); a later version
-- may append fields, so the bound is generous rather than exact.
ALTER TABLE outbox ADD COLUMN traceparent text CHECK (length(traceparent) <= 512);
ALTER TABLE index_task ADD COLUMN traceparent text CHECK (length(traceparent) <= 512);
