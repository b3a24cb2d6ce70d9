-- Publisher, version 3: a document version's content is immutable, in the schema itself.
--
-- The publisher never updates content (its queries only set status and published_at); this
-- trigger makes that a property of the database too, so no other code path, script or
-- operator UPDATE can make stored bytes disagree with their sha256, or change what a
-- published version (and every chunk and event derived from it) says.

CREATE FUNCTION document_version_is_immutable() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.tenant_id IS DISTINCT FROM OLD.tenant_id
       OR NEW.document_id IS DISTINCT FROM OLD.document_id
       OR NEW.version_number IS DISTINCT FROM OLD.version_number
       OR NEW.content IS DISTINCT FROM OLD.content
       OR NEW.media_type IS DISTINCT FROM OLD.media_type
       OR NEW.sha256 IS DISTINCT FROM OLD.sha256
       OR NEW.size_bytes IS DISTINCT FROM OLD.size_bytes
       OR (OLD.status = 'PUBLISHED' AND NEW.status <> 'PUBLISHED') THEN
        RAISE EXCEPTION 'document versions are immutable: upload a new version instead'
            USING ERRCODE = 'integrity_constraint_violation';
    END IF;
    RETURN NEW;
END $$;

CREATE TRIGGER document_version_immutable
    BEFORE UPDATE ON document_version
    FOR EACH ROW EXECUTE FUNCTION document_version_is_immutable();

