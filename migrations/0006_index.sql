-- The search index as the indexer's sink writes it (services/indexer/sink_pgvector.py):
-- chunks carry their chunking strategy, the search pointer names the whole index generation
-- it reads and only ever moves forward, content digests are looked up for embedding reuse,
-- and the generations a deployment has built are registered with their ANN index.

-- An index generation is (embedding model, dimension, chunking strategy) (DESIGN §6): the
-- same text chunked another way is another set of chunks, so the strategy is part of a
-- chunk's identity as much as the model. No default: every deployment's table is still
-- empty, and a guessed strategy would be a lie.
ALTER TABLE knowledge_chunk ADD COLUMN chunking_strategy text NOT NULL;

-- What queries join on, with embedding_model: chunks of the pointer's version, model and
-- strategy. Nullable only because rows written by hand before the sink existed (tests that
-- stand in for it) name no strategy; such a pointer matches no chunk, so it is never half
-- read. The sink always sets it. chunk_count is what the switch wrote: `kb index check`
-- compares it with the chunks present.
ALTER TABLE document_search_version
    ADD COLUMN chunking_strategy text,
    ADD COLUMN chunk_count integer CHECK (chunk_count >= 0);

-- The pointer only ever moves forward (DESIGN §8.6). The sink's upsert already moves it
-- only to a newer version; this guard refuses any other writer (a script, a repair, a bug)
-- that would take it back. The same version may be rewritten (a generation switch: same
-- version, another model or strategy).
CREATE FUNCTION document_search_version_forward_only() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'search version of document %/% cannot move back from % to %',
        OLD.tenant_id, OLD.document_id, OLD.version_number, NEW.version_number
        USING ERRCODE = 'check_violation',
              CONSTRAINT = 'document_search_version_forward_only';
END
$$;

CREATE TRIGGER document_search_version_forward_only
    BEFORE UPDATE ON document_search_version
    FOR EACH ROW
    WHEN (NEW.version_number < OLD.version_number)
    EXECUTE FUNCTION document_search_version_forward_only();

-- Incremental re-indexing: a new version re-embeds only content whose digest this tenant's
-- index (same model and strategy) has not seen. One index probe per digest; the embedding
-- itself is read from the heap (too wide to carry in an index).
CREATE INDEX knowledge_chunk_reuse
    ON knowledge_chunk (tenant_id, embedding_model, chunking_strategy, content_digest);

-- The generations built so far, and the ANN index of each model (one partial HNSW index per
-- model, services/indexer/ann_index.py). Workers register their generation at start
-- (PgVectorSink.ensure_generation); search and `kb index generations` read it to know a
-- generation's dimension and index. A model has one dimension: its ANN index casts every
-- embedding of the model to vector(dimension).
CREATE TABLE index_generation (
    embedding_model    text        NOT NULL,
    chunking_strategy  text        NOT NULL,
    dimension          integer     NOT NULL CHECK (dimension BETWEEN 1 AND 16000),
    ann_index_name     text        NOT NULL,
    created_at         timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (embedding_model, chunking_strategy)
);

-- The shape of the sink's staging table. The sink COPYs a version's chunks into a temporary
-- table of this name and shape (CREATE TEMP TABLE .. (LIKE ..) ON COMMIT DROP), then
-- inserts them into knowledge_chunk with ON CONFLICT DO NOTHING. The temporary table
-- shadows this one inside that transaction (pg_temp is searched first), so the sink's named
-- queries name one table and can be prepared against the migrated schema. This table itself
-- is never written: CHECK (false), which LIKE does not copy.
CREATE TABLE knowledge_chunk_staging (
    chunk_id        text    NOT NULL,
    ordinal         integer NOT NULL,
    heading_path    text[]  NOT NULL,
    text            text    NOT NULL,
    content_digest  bytea   NOT NULL,
    embedding       vector  NOT NULL,
    CONSTRAINT knowledge_chunk_staging_never_written CHECK (false)
);
