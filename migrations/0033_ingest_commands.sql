-- Publish by event (issue 44, docs/architecture.md#publish-by-event): producers send signed
-- commands to kb.ingest.<tier>; `kb ingest run` applies each in the publish's own transaction.
--
-- Three new tables, no change to an existing one: no rewrite, no long lock.
SET LOCAL lock_timeout = '10s';

-- A producer names its documents by its own key (a CMS page id, a ticket number); the first
-- publish of a key creates the document and this row, so a producer never stores our id.
-- One document per key and one key per document: a second key cannot take over a document.
-- A publish of a key whose document was deleted maps the key to a new document.
CREATE TABLE ingest_document_key (
    tenant_id     text        NOT NULL,
    document_key  text        NOT NULL CHECK (length(document_key) BETWEEN 1 AND 512),
    document_id   uuid        NOT NULL,
    created_at    timestamptz NOT NULL,
    PRIMARY KEY (tenant_id, document_key),
    UNIQUE (tenant_id, document_id),
    FOREIGN KEY (tenant_id, document_id) REFERENCES document (tenant_id, document_id)
);

-- Every command applied, by the producer's command id: written first in the command's
-- transaction (a concurrent copy of the same command waits on the key, then finds it), so
-- a command redelivered after its commit changes nothing and answers what it did. The
-- answer columns are the command's outcome; task_id lets the indexer's switch event name
-- the command whose publish created the task.
CREATE TABLE ingest_command (
    tenant_id       text        NOT NULL,
    command_id      uuid        NOT NULL,
    command_type    text        NOT NULL,
    document_id     uuid,
    version_number  integer,
    revision        bigint,
    task_id         uuid,
    -- When the producer's record reached Kafka (its timestamp; NULL: unknown), and when the
    -- command was applied: the operator page's delay per tenant.
    sent_at         timestamptz,
    applied_at      timestamptz NOT NULL,
    PRIMARY KEY (tenant_id, command_id)
);
CREATE INDEX ingest_command_task ON ingest_command (tenant_id, task_id)
    WHERE task_id IS NOT NULL;
CREATE INDEX ingest_command_applied ON ingest_command (tenant_id, applied_at);

-- The Ed25519 public keys a tenant's producers sign their commands with
-- (docs/security.md#publish-by-event). A key works until revoked_at.
CREATE TABLE tenant_ingest_key (
    tenant_id   text        NOT NULL REFERENCES tenant (tenant_id),
    key_id      text        NOT NULL CHECK (key_id ~ '^[A-Za-z0-9._:-]{1,64}$'),
    public_key  bytea       NOT NULL CHECK (length(public_key) = 32),
    created_at  timestamptz NOT NULL DEFAULT now(),
    revoked_at  timestamptz,
    PRIMARY KEY (tenant_id, key_id)
);

-- The ingest consumer applies a command as the tenant's role, behind the wall (migration
-- 0029): it writes what a publish writes, plus the key map and the command record, and
-- reads its tenant's ingest keys. An admin key registers and revokes them through the API,
-- as the same role (`kb tenants ingest-keys` runs as the owner).
ALTER TABLE ingest_document_key ENABLE ROW LEVEL SECURITY;
ALTER TABLE ingest_command ENABLE ROW LEVEL SECURITY;
ALTER TABLE tenant_ingest_key ENABLE ROW LEVEL SECURITY;
CREATE POLICY tenant_wall ON ingest_document_key AS PERMISSIVE FOR ALL TO kb_tenant_api
    USING (tenant_id = current_setting('kb.tenant_id', true))
    WITH CHECK (tenant_id = current_setting('kb.tenant_id', true));
CREATE POLICY tenant_wall ON ingest_command AS PERMISSIVE FOR ALL TO kb_tenant_api
    USING (tenant_id = current_setting('kb.tenant_id', true))
    WITH CHECK (tenant_id = current_setting('kb.tenant_id', true));
CREATE POLICY tenant_wall ON tenant_ingest_key AS PERMISSIVE FOR ALL TO kb_tenant_api
    USING (tenant_id = current_setting('kb.tenant_id', true))
    WITH CHECK (tenant_id = current_setting('kb.tenant_id', true));
GRANT SELECT, INSERT, DELETE ON ingest_document_key TO kb_tenant_api;
GRANT SELECT, INSERT, UPDATE ON ingest_command TO kb_tenant_api;
GRANT SELECT, INSERT, UPDATE ON tenant_ingest_key TO kb_tenant_api;

-- An erase may now be asked for by an ingest command (its audit row says so; no key).
ALTER TABLE document_erasure
    DROP CONSTRAINT document_erasure_requested_by_check,
    ADD CONSTRAINT document_erasure_requested_by_check
        CHECK (requested_by IN ('api', 'cli', 'ingest'));
