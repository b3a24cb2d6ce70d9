-- Erasing a document (issue 43, docs/architecture.md#document-lifecycle): an admin's request
-- removes everything the system holds of a deleted document's content. What stays is this
-- audit row, the tombstone (migration 0030) and ids. The erase runs in short transactions
-- (services/publisher/erase.py): the first deletes the document if it is live and writes
-- this row with erased_at NULL ("in progress"); bounded batches then remove the content; the
-- last sets erased_at. A crash in between leaves the row in progress, and running the erase
-- again finishes it.
--
-- New table, a replaced function and a trigger-free column: no rewrite, no long lock.
SET LOCAL lock_timeout = '10s';

CREATE TABLE document_erasure (
    tenant_id     text        NOT NULL,
    document_id   uuid        NOT NULL,
    -- The API key that asked (an admin key); NULL when an operator ran `kb documents erase`.
    key_id        uuid,
    requested_by  text        NOT NULL CHECK (requested_by IN ('api', 'cli')),
    requested_at  timestamptz NOT NULL,
    -- NULL while the erase is in progress; set once, by the erase's last transaction.
    erased_at     timestamptz,
    PRIMARY KEY (tenant_id, document_id),
    FOREIGN KEY (tenant_id, document_id) REFERENCES document (tenant_id, document_id),
    CHECK (requested_by = 'api' OR key_id IS NULL),
    CHECK (erased_at IS NULL OR erased_at >= requested_at)
);

-- The API's tenant role writes the row in the delete's transaction (migration 0029's wall),
-- and reads it for the status; the batches run as the tables' owner (they touch the chunks,
-- the staging table and the outbox, which the role may not write).
ALTER TABLE document_erasure ENABLE ROW LEVEL SECURITY;
CREATE POLICY tenant_wall ON document_erasure AS PERMISSIVE FOR ALL TO kb_tenant_api
    USING (tenant_id = current_setting('kb.tenant_id', true))
    WITH CHECK (tenant_id = current_setting('kb.tenant_id', true));
GRANT SELECT, INSERT ON document_erasure TO kb_tenant_api;

-- A version's content is immutable (migration 0003) with one exception: the erase empties
-- it, once the document has an erasure row. sha256, size and media type stay (metadata, as
-- in the events already in Kafka); nothing else may change.
CREATE OR REPLACE FUNCTION document_version_is_immutable() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.tenant_id IS DISTINCT FROM OLD.tenant_id
       OR NEW.document_id IS DISTINCT FROM OLD.document_id
       OR NEW.version_number IS DISTINCT FROM OLD.version_number
       OR (NEW.content IS DISTINCT FROM OLD.content
           AND NOT (NEW.content = ''::bytea
                    AND EXISTS (SELECT 1 FROM document_erasure e
                                 WHERE e.tenant_id = OLD.tenant_id
                                   AND e.document_id = OLD.document_id)))
       OR NEW.media_type IS DISTINCT FROM OLD.media_type
       OR NEW.sha256 IS DISTINCT FROM OLD.sha256
       OR NEW.size_bytes IS DISTINCT FROM OLD.size_bytes
       OR (OLD.status = 'PUBLISHED' AND NEW.status <> 'PUBLISHED') THEN
        RAISE EXCEPTION 'document versions are immutable: upload a new version instead'
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    RETURN NEW;
END $$;
