-- kb-pipeline schema, version 1: every table of DESIGN §3 with its keys, and the indexes
-- the index-task claim needs. Later changes go into new numbered files; an applied file
-- is never edited (`kb migrate` checks its checksum).

CREATE EXTENSION IF NOT EXISTS vector;

-- Tenants -----------------------------------------------------------------------------------

CREATE TABLE tenant (
    tenant_id   text        PRIMARY KEY
                            CHECK (tenant_id ~ '^[a-z0-9][a-z0-9-]{0,62}$'),
    tier        text        NOT NULL
                            CHECK (tier ~ '^[a-z0-9][a-z0-9_-]{0,31}$'),
    created_at  timestamptz NOT NULL DEFAULT now()
);

-- Only a SHA-256 of each key is stored: a database dump gives nobody a usable key.
CREATE TABLE tenant_api_key (
    key_id      uuid        PRIMARY KEY,
    tenant_id   text        NOT NULL REFERENCES tenant (tenant_id),
    key_hash    bytea       NOT NULL UNIQUE CHECK (length(key_hash) = 32),
    created_at  timestamptz NOT NULL DEFAULT now(),
    revoked_at  timestamptz
);
CREATE INDEX tenant_api_key_tenant ON tenant_api_key (tenant_id);

-- Documents and their immutable versions -----------------------------------------------------

CREATE TABLE document (
    tenant_id          text        NOT NULL REFERENCES tenant (tenant_id),
    document_id        uuid        NOT NULL,
    title              text        NOT NULL CHECK (length(title) BETWEEN 1 AND 500),
    -- Optimistic concurrency: bumped by every change; writers send the revision they read.
    revision           bigint      NOT NULL DEFAULT 1 CHECK (revision >= 1),
    latest_version     integer     NOT NULL DEFAULT 0 CHECK (latest_version >= 0),
    published_version  integer     CHECK (published_version >= 1),
    published_at       timestamptz,
    created_at         timestamptz NOT NULL DEFAULT now(),
    updated_at         timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, document_id)
);

CREATE TABLE document_version (
    tenant_id       text        NOT NULL,
    document_id     uuid        NOT NULL,
    version_number  integer     NOT NULL CHECK (version_number >= 1),
    content         bytea       NOT NULL,
    media_type      text        NOT NULL,
    sha256          bytea       NOT NULL CHECK (length(sha256) = 32),
    size_bytes      bigint      NOT NULL CHECK (size_bytes >= 0),
    status          text        NOT NULL DEFAULT 'DRAFT'
                                CHECK (status IN ('DRAFT', 'PUBLISHED')),
    created_at      timestamptz NOT NULL DEFAULT now(),
    published_at    timestamptz,
    PRIMARY KEY (tenant_id, document_id, version_number),
    FOREIGN KEY (tenant_id, document_id) REFERENCES document (tenant_id, document_id)
);

CREATE TABLE document_acl (
    tenant_id    text NOT NULL,
    document_id  uuid NOT NULL,
    principal    text NOT NULL CHECK (length(principal) BETWEEN 1 AND 200),
    permission   text NOT NULL CHECK (permission IN ('READ')),
    PRIMARY KEY (tenant_id, document_id, principal, permission),
    FOREIGN KEY (tenant_id, document_id) REFERENCES document (tenant_id, document_id)
);

-- Index tasks ---------------------------------------------------------------------------------

CREATE TABLE index_task (
    task_id          uuid        PRIMARY KEY,
    tenant_id        text        NOT NULL,
    document_id      uuid        NOT NULL,
    version_number   integer     NOT NULL,
    task_type        text        NOT NULL DEFAULT 'INDEX_VERSION',
    -- Copied from the tenant at creation so that a tier's claim never joins tenant.
    tier             text        NOT NULL,
    status           text        NOT NULL DEFAULT 'PENDING'
                                 CHECK (status IN ('PENDING', 'RUNNING', 'RETRY_WAIT',
                                                   'SUCCEEDED', 'DEAD')),
    -- After a claim, `attempts` is the lease generation (lease_attempt) used for fencing.
    attempts         integer     NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    max_attempts     integer     NOT NULL DEFAULT 8 CHECK (max_attempts >= 1),
    lease_owner      text,
    lease_until      timestamptz,
    next_attempt_at  timestamptz NOT NULL DEFAULT now(),
    error_code       text,
    error_message    text,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now(),
    finished_at      timestamptz,
    CONSTRAINT index_task_business_key
        UNIQUE (tenant_id, document_id, version_number, task_type),
    FOREIGN KEY (tenant_id, document_id, version_number)
        REFERENCES document_version (tenant_id, document_id, version_number),
    CONSTRAINT index_task_running_has_lease
        CHECK (status <> 'RUNNING' OR (lease_owner IS NOT NULL AND lease_until IS NOT NULL))
)
-- Free space on each page lets heartbeats (which touch only non-indexed columns) stay HOT
-- updates: no index churn, no bloat on the hot path.
WITH (fillfactor = 70);

-- The claim scans only these two partial indexes; SUCCEEDED and DEAD rows are in neither,
-- so a table full of finished tasks costs the claim nothing. lease_until is deliberately
-- not indexed: heartbeats update it and must stay HOT; RUNNING rows are few per tier.
CREATE INDEX index_task_due ON index_task (tier, next_attempt_at)
    WHERE status IN ('PENDING', 'RETRY_WAIT');
CREATE INDEX index_task_running ON index_task (tier)
    WHERE status = 'RUNNING';
CREATE INDEX index_task_document ON index_task (tenant_id, document_id, version_number);

-- Outbox --------------------------------------------------------------------------------------

-- One row per event, inserted in the producer's own transaction. `position` orders rows
-- by insertion but sequences commit out of order, so the relay reads by `txid` (the
-- inserting transaction's xid8) against pg_current_snapshot(): a row becomes visible to the
-- relay only once every transaction that could precede it has finished.
CREATE TABLE outbox (
    position        bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    txid            xid8        NOT NULL DEFAULT pg_current_xact_id(),
    event_id        uuid        NOT NULL UNIQUE,
    event_type      text        NOT NULL,
    tenant_id       text        NOT NULL,
    tier            text        NOT NULL,
    -- Kafka key "<tenant>/<document>": per-document order rides on Kafka's per-key order.
    aggregate_key   text        NOT NULL,
    -- Avro single-object encoding: magic, CRC-64-AVRO fingerprint, body.
    payload         bytea       NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX outbox_txid ON outbox (txid, position);
CREATE INDEX outbox_created_at ON outbox (created_at);

-- Search index --------------------------------------------------------------------------------

CREATE TABLE knowledge_chunk (
    tenant_id            text        NOT NULL,
    document_id          uuid        NOT NULL,
    version_number       integer     NOT NULL,
    embedding_model      text        NOT NULL,
    chunk_id             text        NOT NULL,
    ordinal              integer     NOT NULL CHECK (ordinal >= 0),
    heading_path         text[]      NOT NULL DEFAULT '{}',
    text                 text        NOT NULL,
    content_digest       bytea       NOT NULL,
    embedding_dimension  integer     NOT NULL CHECK (embedding_dimension > 0),
    -- No fixed dimension here: model and dimension are part of the index identity, and
    -- each model gets its own (partial, expression) ANN index when it is introduced.
    embedding            vector      NOT NULL
                                     CHECK (vector_dims(embedding) = embedding_dimension),
    created_at           timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, document_id, version_number, embedding_model, chunk_id),
    FOREIGN KEY (tenant_id, document_id, version_number)
        REFERENCES document_version (tenant_id, document_id, version_number)
);

-- What queries read: one complete version per document, only ever moving forward.
CREATE TABLE document_search_version (
    tenant_id        text        NOT NULL,
    document_id      uuid        NOT NULL,
    version_number   integer     NOT NULL,
    embedding_model  text        NOT NULL,
    task_id          uuid,
    switched_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, document_id),
    FOREIGN KEY (tenant_id, document_id) REFERENCES document (tenant_id, document_id),
    FOREIGN KEY (tenant_id, document_id, version_number)
        REFERENCES document_version (tenant_id, document_id, version_number)
);
