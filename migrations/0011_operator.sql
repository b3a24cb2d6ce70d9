-- Operator page, version 11: operator keys and sessions, and the indexes its pages read.

-- Operator keys are not tenant keys: they open /ui and nothing under /v1. Only a SHA-256 is
-- stored. `kb operators create NAME` makes one; KB_OPERATOR_TOKEN is a key kept outside.
CREATE TABLE operator_key (
    operator_id  uuid        PRIMARY KEY,
    name         text        NOT NULL UNIQUE CHECK (length(name) BETWEEN 1 AND 100),
    key_hash     bytea       NOT NULL UNIQUE CHECK (length(key_hash) = 32),
    created_at   timestamptz NOT NULL DEFAULT now(),
    revoked_at   timestamptz
);

-- A signed-in browser holds a random session token in an HttpOnly cookie; the table holds
-- its hash, who it is, and the CSRF token every form must send back.
CREATE TABLE operator_session (
    session_hash   bytea       PRIMARY KEY CHECK (length(session_hash) = 32),
    operator_name  text        NOT NULL,
    csrf_token     text        NOT NULL,
    created_at     timestamptz NOT NULL DEFAULT now(),
    expires_at     timestamptz NOT NULL
);
CREATE INDEX operator_session_expires ON operator_session (expires_at);

-- Dead tasks by tier, tenant and error code: the dead-letter page and its counts read only
-- these rows, however many tasks succeeded. Not updated_at: heartbeats set it, and an
-- indexed column would cost them their HOT updates.
CREATE INDEX index_task_dead ON index_task (tier, tenant_id, error_code, finished_at)
    WHERE status = 'DEAD';

-- The overview's last hour: finished tasks per minute, and switches for publish->searchable.
CREATE INDEX index_task_finished ON index_task (finished_at) WHERE finished_at IS NOT NULL;
CREATE INDEX document_search_version_switched ON document_search_version (switched_at);
