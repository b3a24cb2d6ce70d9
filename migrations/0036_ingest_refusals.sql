-- Publish by event, batched and fair (issue 44, docs/architecture.md#publish-by-event): `kb ingest run`
-- applies a partition's run of commands in one transaction, each in a savepoint. A signed
-- command its savepoint refused is sent to the dead-letter topic inside that transaction
-- and recorded here by where it was read, so a run redelivered after the commit (a consumer
-- killed before its offset commit) does not dead-letter it twice.
--
-- Two new tables, no change to an existing one: no rewrite, no long lock.
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

-- What each `kb ingest run` process holds, fetched and not yet applied, per tenant: written
-- by the process every KB_INGEST_BACKLOG_REPORT_SECONDS (its rows replaced), read by the
-- operator page (rows older than a minute are a stopped process's, and ignored). Written
-- by the consumer's own role across tenants, as the relay writes; the wall's role gets no
-- grant.
CREATE TABLE ingest_backlog (
    tier            text        NOT NULL,
    consumer_id     uuid        NOT NULL,
    tenant_id       text        NOT NULL,
    records         integer     NOT NULL CHECK (records >= 0),
    oldest_sent_at  timestamptz,
    reported_at     timestamptz NOT NULL,
    PRIMARY KEY (tenant_id, tier, consumer_id)
);

ALTER TABLE ingest_backlog ENABLE ROW LEVEL SECURITY;
CREATE POLICY tenant_wall ON ingest_backlog AS PERMISSIVE FOR ALL TO kb_tenant_api
    USING (tenant_id = current_setting('kb.tenant_id', true))
    WITH CHECK (tenant_id = current_setting('kb.tenant_id', true));
