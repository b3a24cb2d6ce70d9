-- Relay (outbox -> Kafka): leased partitions of the outbox, their delivery progress, and
-- the wake-up signal. See services/relay/queries.sql for how these are read and fenced.

-- The outbox is split into `partition_count` lease partitions by a hash of aggregate_key
-- (so every event of one document belongs to one partition, hence one relay at a time).
-- A relay instance drives a partition only while it holds the lease: owner + epoch +
-- lease_until, like index tasks. Every acquisition bumps `epoch`; every progress write is
-- fenced on (owner, epoch, lease_until > now), so a relay that lost its lease cannot move
-- progress, and it stops driving the partition the moment its own (shorter) local view
-- of the lease runs out.
--
-- Progress is a PgQ-style pair of snapshots, not a position: every outbox row whose txid
-- is visible in `delivered_snapshot` has been acknowledged by Kafka. `window_snapshot` is
-- the snapshot the relay is draining now (rows visible in it but not in
-- delivered_snapshot), `window_end` the highest position in that window, and
-- `window_position` how far (by position) it is acknowledged; when the window is drained
-- it becomes the new delivered_snapshot.
CREATE TABLE relay_partition (
    partition           integer     PRIMARY KEY CHECK (partition >= 0),
    partition_count     integer     NOT NULL CHECK (partition_count > partition),
    owner               text,
    epoch               bigint      NOT NULL DEFAULT 0,
    lease_until         timestamptz,
    -- '1:1:' sees no transaction at all: a new partition starts from the first row.
    delivered_snapshot  pg_snapshot NOT NULL DEFAULT '1:1:',
    window_snapshot     pg_snapshot,
    window_position     bigint      NOT NULL DEFAULT 0,
    window_end          bigint      NOT NULL DEFAULT 0,
    progressed_at       timestamptz,
    CHECK ((owner IS NULL) = (lease_until IS NULL))
);

-- Wake the relay when rows are committed. Statement-level (one notify per INSERT statement,
-- not per row) and with a constant payload, which PostgreSQL folds into a single
-- notification per transaction; it is delivered only after the commit. The relay also
-- polls on a timer, so a lost notification costs latency, never a row.
CREATE FUNCTION outbox_notify_relay() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('kb_outbox', '');
    RETURN NULL;
END
$$;

CREATE TRIGGER outbox_notify_relay
    AFTER INSERT ON outbox
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_notify_relay();
