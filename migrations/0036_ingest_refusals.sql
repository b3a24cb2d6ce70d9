-- Publish by event, batched (issue 44, docs/architecture.md#publish-by-event): `kb ingest run`
-- applies a partition's run of commands in one transaction, each in a savepoint. A signed
-- command its savepoint refused is sent to the dead-letter topic inside that transaction
-- and recorded here by where it was read, so a run redelivered after the commit (a consumer
-- killed before its offset commit) does not dead-letter it twice.
--
-- One new table, no change to an existing one: no rewrite, no long lock.
SET LOCAL lock_timeout = '10s';

CREATE TABLE ingest_refusal (
    tenant_id   text        NOT NULL,
    -- topic/partition/offset the command was read at (the dead letter's kb-source header):
    -- a replayed dead letter, read elsewhere, is not one of these.
    source      text        NOT NULL CHECK (length(source) <= 512),
    command_id  uuid        NOT NULL,
    code        text        NOT NULL,
    refused_at  timestamptz NOT NULL,
    PRIMARY KEY (tenant_id, source)
);
CREATE INDEX ingest_refusal_refused ON ingest_refusal (refused_at);

ALTER TABLE ingest_refusal ENABLE ROW LEVEL SECURITY;
CREATE POLICY tenant_wall ON ingest_refusal AS PERMISSIVE FOR ALL TO kb_tenant_api
    USING (tenant_id = current_setting('kb.tenant_id', true))
    WITH CHECK (tenant_id = current_setting('kb.tenant_id', true));
GRANT SELECT, INSERT ON ingest_refusal TO kb_tenant_api;
