-- Search: PostgreSQL full-text search over the chunks (the keyword half of hybrid search),
-- a text search configuration per tenant, and the ACL lookup search filters on.

-- Which text search configuration (stemming, stop words) a tenant's chunks and queries use.
-- 'simple' (lower-casing only, no stop words) is right for every language, if not the best
-- for any one; a tenant writing English can ask for 'english'.
ALTER TABLE tenant
    ADD COLUMN text_search_config regconfig NOT NULL DEFAULT 'simple';

-- array_to_string is only STABLE (it calls the element type's output function, which may
-- depend on settings); for text[] it cannot change, so this wrapper may say IMMUTABLE, which
-- a generated column requires.
CREATE FUNCTION kb_heading_text(heading_path text[]) RETURNS text
    LANGUAGE sql IMMUTABLE PARALLEL SAFE STRICT
    RETURN array_to_string(heading_path, ' ');

-- A generated column can only read its own row, so the chunk carries its tenant's
-- configuration: the trigger below copies it from `tenant` when the chunk is inserted
-- (writers need not know about it). A tenant that changes its configuration gets it for
-- chunks written afterwards; queries use the tenant's current one, so re-index the tenant
-- after a change.
ALTER TABLE knowledge_chunk
    ADD COLUMN text_search_config regconfig NOT NULL DEFAULT 'simple';

-- Headings weigh more than body text (A over B) in ts_rank_cd.
ALTER TABLE knowledge_chunk
    ADD COLUMN search_document tsvector GENERATED ALWAYS AS (
        setweight(to_tsvector(text_search_config, coalesce(kb_heading_text(heading_path), '')), 'A')
        || setweight(to_tsvector(text_search_config, text), 'B')
    ) STORED;

CREATE FUNCTION kb_chunk_text_search_config() RETURNS trigger
    LANGUAGE plpgsql AS $$
BEGIN
    -- Stored generated columns are computed after BEFORE triggers run, so the tsvector is
    -- built with the configuration set here.
    NEW.text_search_config := coalesce(
        (SELECT t.text_search_config FROM tenant t WHERE t.tenant_id = NEW.tenant_id),
        'simple'::regconfig);
    RETURN NEW;
END;
$$;

CREATE TRIGGER knowledge_chunk_text_search_config
    BEFORE INSERT ON knowledge_chunk
    FOR EACH ROW EXECUTE FUNCTION kb_chunk_text_search_config();

CREATE INDEX knowledge_chunk_search_document ON knowledge_chunk USING gin (search_document);

-- Search asks "which documents may these principals read?" per tenant and principal; the
-- primary key leads with the document instead.
CREATE INDEX document_acl_read_principal ON document_acl (tenant_id, principal, document_id)
    WHERE permission = 'READ';
