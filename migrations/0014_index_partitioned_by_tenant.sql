-- The index, partitioned by tenant (HASH, 32 partitions), each partition with its own HNSW
-- graph per model.
--
-- Why: every search is within one tenant. With one graph per model over all tenants, a
-- tenant is a sliver of the graph (1 % of it for one of 100 tenants): walking the graph
-- with the tenant as a filter visits ~100 chunks of other tenants for each of its own, so
-- the planner (rightly) ranks the tenant's readable chunks exactly instead -- which grows
-- with the tenant: 184 ms for 10,000 chunks (bench/results/search.md, 1M chunks). A
-- partition holds a few tenants, its graph is the tenant's neighbourhood, and a search
-- prunes to it at planning (the tenant is a literal in search's custom plans).
--
-- Why HASH and not one partition per tenant: tenants come and go through the publisher's
-- API, and a partition per tenant would need DDL at each; 32 is fixed here (changing it is a
-- rewrite, like this migration). Skew is handled by search, not the layout: a small tenant
-- sharing a partition with a large one is ranked exactly (services/indexer/search.sql).
--
-- Every column, constraint and index keeps its name and meaning; the primary key already
-- leads with tenant_id, which a partitioned table's unique keys must include.

CREATE TABLE knowledge_chunk_partitioned (
    tenant_id            text        NOT NULL,
    document_id          uuid        NOT NULL,
    version_number       integer     NOT NULL,
    embedding_model      text        NOT NULL,
    chunk_id             text        NOT NULL,
    ordinal              integer     NOT NULL
                                     CONSTRAINT knowledge_chunk_ordinal_check CHECK (ordinal >= 0),
    heading_path         text[]      NOT NULL DEFAULT '{}',
    text                 text        NOT NULL,
    content_digest       bytea       NOT NULL,
    embedding_dimension  integer     NOT NULL
                                     CONSTRAINT knowledge_chunk_embedding_dimension_check
                                     CHECK (embedding_dimension > 0),
    embedding            vector      NOT NULL
                                     CONSTRAINT knowledge_chunk_embedding_check
                                     CHECK (vector_dims(embedding) = embedding_dimension),
    created_at           timestamptz NOT NULL DEFAULT now(),
    chunking_strategy    text        NOT NULL,
    text_search_config   regconfig   NOT NULL DEFAULT 'simple',
    search_document      tsvector    GENERATED ALWAYS AS (
        setweight(to_tsvector(text_search_config, coalesce(kb_heading_text(heading_path), '')), 'A')
        || setweight(to_tsvector(text_search_config, text), 'B')
    ) STORED
) PARTITION BY HASH (tenant_id);

-- A chunk stays whole in its row: search reads the vector of every chunk it ranks
-- exactly, and the tsvector of every keyword candidate, and a value moved out of line (TOAST)
-- costs ~3 more buffers to read. A 384-dimension chunk is ~3.2 kB (vector 1,544 bytes,
-- tsvector ~1 kB, text ~0.5 kB): over PostgreSQL's default 2 kB threshold, which moved the
-- vector out (bench/results/search.md: ~18 us a chunk ranked). Each partition keeps rows up
-- to 4,080 bytes (two to a page) as they are: ranking a tenant's 10,000 chunks by ts_rank
-- took 67 ms with the tsvectors out of line, 15 ms in the row; by vector 13 vs 12 ms.
-- Longer rows go to TOAST text and tsvector first: the vector is MAIN (out of line last).
ALTER TABLE knowledge_chunk_partitioned ALTER COLUMN embedding SET STORAGE MAIN;

DO $$
BEGIN
    FOR remainder IN 0..31 LOOP
        EXECUTE format(
            'CREATE TABLE knowledge_chunk_p%s PARTITION OF knowledge_chunk_partitioned'
            ' FOR VALUES WITH (MODULUS 32, REMAINDER %s) WITH (toast_tuple_target = 4080)',
            lpad(remainder::text, 2, '0'), remainder);
    END LOOP;
END
$$;

-- The chunks written so far, tsvectors recomputed (a generated column cannot be copied).
INSERT INTO knowledge_chunk_partitioned
       (tenant_id, document_id, version_number, embedding_model, chunk_id, ordinal,
        heading_path, text, content_digest, embedding_dimension, embedding, created_at,
        chunking_strategy, text_search_config)
SELECT tenant_id, document_id, version_number, embedding_model, chunk_id, ordinal,
       heading_path, text, content_digest, embedding_dimension, embedding, created_at,
       chunking_strategy, text_search_config
  FROM knowledge_chunk;

-- Drops its indexes, trigger and each model's ANN index with it: the indexer's workers
-- rebuild a model's ANN index at start (PgVectorSink.ensure_generation), partition by
-- partition. Until then a vector search ranks exactly.
DROP TABLE knowledge_chunk;
ALTER TABLE knowledge_chunk_partitioned RENAME TO knowledge_chunk;

ALTER TABLE knowledge_chunk
    ADD CONSTRAINT knowledge_chunk_pkey
        PRIMARY KEY (tenant_id, document_id, version_number, embedding_model, chunk_id),
    ADD CONSTRAINT knowledge_chunk_tenant_id_document_id_version_number_fkey
        FOREIGN KEY (tenant_id, document_id, version_number)
        REFERENCES document_version (tenant_id, document_id, version_number);

CREATE INDEX knowledge_chunk_reuse
    ON knowledge_chunk (tenant_id, embedding_model, chunking_strategy, content_digest);
CREATE INDEX knowledge_chunk_search_document ON knowledge_chunk USING gin (search_document);

CREATE TRIGGER knowledge_chunk_text_search_config
    BEFORE INSERT ON knowledge_chunk
    FOR EACH ROW EXECUTE FUNCTION kb_chunk_text_search_config();
