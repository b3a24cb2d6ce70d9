-- The retention of superseded versions' content (issue 43, docs/architecture.md#document-
-- lifecycle): once a newer version is published, an older version can never be published or
-- served again (the publisher refuses it: VERSION_SUPERSEDED; search only moves forward), so
-- its bytes and its chunks (the only place its extracted text is stored) are kept for
-- KB_RETENTION_SUPERSEDED_DAYS and then removed by the collector
-- (services/indexer/gc/retention.py). What stays: the version row (number, media type,
-- sha256, size, its times), its tasks and their codes, the tombstones and the erasure audit.
--
-- Two nullable columns without a default (catalog changes), a NOT VALID check (no scan), a
-- trigger, a replaced function, one UPDATE of the versions already superseded and a partial
-- index. The UPDATE and the index build hold document_version's rows and table for as long
-- as they take (seconds on millions of versions): publishes wait meanwhile. Give up after
-- 10 s in the queue for a lock rather than hold publishes up behind a long writer.
SET LOCAL lock_timeout = '10s';

-- superseded_at: when a newer version of the document was first published (NULL: the
-- version is the published one, or above it, or nothing is published). The retention period
-- counts from there. Set by the trigger below, once, on the database's clock of the publish.
-- content_removed_at: when retention emptied the content and deleted the chunks (NULL: the
-- content is there, or an erase emptied it: document_erasure says that). Once set, the
-- indexer refuses the version (VERSION_CONTENT_REMOVED) instead of reading empty bytes.
ALTER TABLE document_version
    ADD COLUMN superseded_at timestamptz,
    ADD COLUMN content_removed_at timestamptz,
    ADD CONSTRAINT document_version_removed_content_is_empty
        CHECK (content_removed_at IS NULL
               OR (content = ''::bytea AND superseded_at IS NOT NULL
                   AND content_removed_at >= superseded_at))
        NOT VALID;

-- A version's row stays immutable (migrations 0003 and 0031), with these exceptions: the
-- erase empties the content once the document has an erasure row; retention empties it
-- together with setting content_removed_at; superseded_at and content_removed_at are each
-- set once and never change again.
CREATE OR REPLACE FUNCTION document_version_is_immutable() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.tenant_id IS DISTINCT FROM OLD.tenant_id
       OR NEW.document_id IS DISTINCT FROM OLD.document_id
       OR NEW.version_number IS DISTINCT FROM OLD.version_number
       OR (NEW.content IS DISTINCT FROM OLD.content
           AND NOT (NEW.content = ''::bytea
                    AND (NEW.content_removed_at IS NOT NULL
                         OR EXISTS (SELECT 1 FROM document_erasure e
                                     WHERE e.tenant_id = OLD.tenant_id
                                       AND e.document_id = OLD.document_id))))
       OR NEW.media_type IS DISTINCT FROM OLD.media_type
       OR NEW.sha256 IS DISTINCT FROM OLD.sha256
       OR NEW.size_bytes IS DISTINCT FROM OLD.size_bytes
       OR (OLD.superseded_at IS NOT NULL AND NEW.superseded_at IS DISTINCT FROM OLD.superseded_at)
       OR (OLD.content_removed_at IS NOT NULL
           AND NEW.content_removed_at IS DISTINCT FROM OLD.content_removed_at)
       OR (OLD.status = 'PUBLISHED' AND NEW.status <> 'PUBLISHED') THEN
        RAISE EXCEPTION 'document versions are immutable: upload a new version instead'
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    RETURN NEW;
END $$;

-- Every writer that raises a document's published version (a publish, a bulk publish, a
-- script) supersedes the versions below it, in its own transaction: the time is the newly
-- published version's published_at (the publish's injectable now), else the database's
-- clock. Published versions only rise, so a version superseded stays superseded. Runs as the
-- writer (the API's tenant role updates only its own tenant's versions: migration 0029).
CREATE FUNCTION document_versions_superseded() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE document_version v
       SET superseded_at = coalesce(
               (SELECT p.published_at FROM document_version p
                 WHERE p.tenant_id = NEW.tenant_id
                   AND p.document_id = NEW.document_id
                   AND p.version_number = NEW.published_version),
               NEW.published_at, now())
     WHERE v.tenant_id = NEW.tenant_id
       AND v.document_id = NEW.document_id
       AND v.version_number < NEW.published_version
       AND v.superseded_at IS NULL;
    RETURN NULL;
END $$;

CREATE TRIGGER document_versions_superseded
    AFTER UPDATE OF published_version ON document
    FOR EACH ROW
    WHEN (NEW.published_version > coalesce(OLD.published_version, 0))
    EXECUTE FUNCTION document_versions_superseded();

-- The versions superseded before this migration: from the first publish above each of them,
-- or, when that time is unknown, the document's current publish.
UPDATE document_version v
   SET superseded_at = coalesce(
           (SELECT min(w.published_at) FROM document_version w
             WHERE w.tenant_id = v.tenant_id
               AND w.document_id = v.document_id
               AND w.version_number > v.version_number
               AND w.published_at IS NOT NULL),
           d.published_at, now())
  FROM document d
 WHERE d.tenant_id = v.tenant_id
   AND d.document_id = v.document_id
   AND v.version_number < d.published_version;

-- What the collector reads: the versions superseded and not yet removed, oldest first. The
-- versions of a settled corpus (removed, or never superseded) are not in it.
CREATE INDEX document_version_retention_due ON document_version (superseded_at)
    WHERE superseded_at IS NOT NULL AND content_removed_at IS NULL;

-- What the operator page counts and lists on every refresh (services/operator/queries.sql:
-- lifecycle_totals, recent_deletes, recent_retention): only the versions retention emptied
-- and the deleted documents, never a scan of every row; the sizes ride in the index, so
-- the bytes removed are summed from it alone.
CREATE INDEX document_version_content_removed ON document_version (content_removed_at)
    INCLUDE (size_bytes) WHERE content_removed_at IS NOT NULL;
CREATE INDEX document_deleted ON document (deleted_at) WHERE deleted_at IS NOT NULL;
