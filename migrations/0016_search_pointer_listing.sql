-- The exact vector list (services/indexer/search.sql: searchable_chunks_listed) lists the
-- readable documents' current search versions in one scan of this index: the documents the
-- caller's principals may READ go in as one array (document_id = ANY (...)), and each
-- document's version and chunking strategy come out of the index itself (an index-only
-- scan), where probing the primary key document by document read each pointer's heap page
-- too (1M bench, typical user, ~260 readable documents: 1.2-1.5 ms -> 0.5 ms).
--
-- It replaces migrations/0015's index (the same keys; choose_vector_path's running sum of
-- chunk counts reads it as before). Pointers already change every indexed column on each
-- switch (version, chunk count): the wider index costs no HOT update that was possible.
-- A plain CREATE INDEX: while it builds (seconds per million documents) pointer switches
-- wait, searches do not; the DROP takes the table's lock for a moment. Queued behind a long
-- reader of the table, that lock would hold every search up behind it: the migration gives
-- up after 10 s instead (and is rolled back whole; run `kb migrate` again).
SET LOCAL lock_timeout = '10s';

CREATE INDEX document_search_version_current
    ON document_search_version (tenant_id, embedding_model, document_id)
    INCLUDE (version_number, chunking_strategy, chunk_count);

DROP INDEX document_search_version_readable;
