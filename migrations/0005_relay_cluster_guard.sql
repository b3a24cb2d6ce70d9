-- Relay: progress belongs to one PostgreSQL cluster.
--
-- delivered_snapshot, window_snapshot and outbox.txid are transaction ids, meaningful only
-- within the xid history of the cluster that assigned them. After pg_dump/restore, logical
-- replication or a managed blue/green switchover the new cluster's counter can be behind
-- the stored snapshots: new rows would then look "already delivered" and be skipped in
-- silence. So each partition records the cluster its progress was made on, and the relay
-- refuses to drive a partition (services/relay/outbox_pg.py: "Progress belongs to one
-- cluster", including how to re-seed) whose progress is from another cluster or ahead of
-- this cluster's transaction counter.

-- pg_control_system().system_identifier of the cluster the progress was recorded on; NULL
-- until a relay first takes the partition (it then records the cluster it runs on).
ALTER TABLE relay_partition ADD COLUMN cluster_id bigint;

CREATE FUNCTION relay_cluster_id() RETURNS bigint
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT system_identifier FROM pg_control_system()
$$;

-- Why a partition's stored progress cannot be trusted on this cluster, or NULL when it
-- can: another cluster recorded it, or it is ahead of this cluster's transaction counter.
CREATE FUNCTION relay_partition_refusal(
    cluster_id bigint, delivered pg_snapshot, in_window pg_snapshot
) RETURNS text
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT CASE
        WHEN cluster_id IS NOT NULL AND cluster_id <> relay_cluster_id()
            THEN 'progress was recorded on another cluster (system identifier '
                 || cluster_id || ', this one is ' || relay_cluster_id() || ')'
        WHEN pg_snapshot_xmax(delivered) > pg_snapshot_xmax(pg_current_snapshot())
          OR pg_snapshot_xmax(in_window) > pg_snapshot_xmax(pg_current_snapshot())
            THEN 'progress is ahead of this cluster''s transaction counter (delivered xmax '
                 || pg_snapshot_xmax(delivered) || ', current xmax '
                 || pg_snapshot_xmax(pg_current_snapshot()) || ')'
    END
$$;
