-- Relay: a window's late committers are read by transaction id, not by position range;
-- writers notify the relay only while it waits (the doorbell, below).
--
-- A window holds the rows of transactions that committed since the delivered snapshot:
-- those that were still open when it was taken ("late committers", txid in its
-- in-progress list) and those that started after it (txid >= its xmax). The latter took
-- their positions after every row the delivered snapshot sees, so they lie at or above
-- `window_start` (the lowest of their positions). A late committer's rows may lie far
-- below it -- a transaction that inserted early and committed an hour later -- with an
-- hour of delivered rows in between. The relay reads rows below `window_start` by their
-- transaction ids (index probes on outbox_txid) and only the rest by position range, so
-- those delivered rows are never read again. 0 (progress from before this migration):
-- every row of the window is read by position range, as before.
ALTER TABLE relay_partition ADD COLUMN window_start bigint NOT NULL DEFAULT 0;

-- Relay wake-ups: notify only while a relay waits for rows.
--
-- PostgreSQL serialises the commits of every transaction that sent a NOTIFY (a
-- cluster-wide lock held through the commit), so notifying on every outbox insert capped
-- publish throughput (bench/outbox_notify.py: ~19% fewer commits/s at 16 writers). The
-- doorbell is armed by a relay about to wait (after arming it reads once more, so a row
-- committed just before is not missed) and disarmed by the relay that a notification woke;
-- writers notify only while it is armed. While relays are busy draining, no writer
-- notifies. Losing a wake-up still costs only latency: relays also poll on a timer.
CREATE TABLE relay_doorbell (
    singleton   boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    armed       boolean NOT NULL DEFAULT true
);
INSERT INTO relay_doorbell DEFAULT VALUES;

CREATE OR REPLACE FUNCTION outbox_notify_relay() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF (SELECT armed FROM relay_doorbell) THEN
        PERFORM pg_notify('kb_outbox', '');
    END IF;
    RETURN NULL;
END
$$;
