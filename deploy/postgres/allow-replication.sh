#!/usr/bin/env bash
# Run once by the postgres image when it initialises an empty data dir (compose.yaml mounts
# it into /docker-entrypoint-initdb.d): lets the `replicas` profile's standby stream WAL
# with the same password as every other connection.
set -euo pipefail
echo "host replication all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
