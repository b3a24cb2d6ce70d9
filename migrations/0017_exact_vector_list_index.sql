-- The exact vector list (services/indexer/search.sql: vector_list_exact) ranks every chunk
-- the caller's principals may read. Read from the rows, each ranked chunk costs a heap tuple
-- of ~3.2 kB (text and tsvector beside the vector: two rows to a page); this index holds
-- the primary key's columns, the chunking strategy the search pointer names, the dimension
-- and the vector itself, so ranking the readable chunks of a document is one index-only
-- scan of adjacent leaf entries (~1.6 kB each, five to a page). 1M bench, typical user (~3,000 chunks
-- ranked): the vector list 10.9 -> 7.8 ms p50, the same lists.
--
-- A btree entry holds at most ~2.7 kB: only vectors of up to 512 dimensions go in (2,056
-- bytes; the keys take the rest: a tenant id of up to 63 characters, a model name of up to
-- 200, a 32-character chunk id and the chunking strategy's name). A larger model's chunks
-- are simply not in it, and its exact list reads the rows as before: the statement names its
-- dimension, which implies this predicate only for small ones (search_sql).
--
-- Its size is about the vectors' own (~1.9 GiB per million 384-dimension chunks), the price
-- of ranking them from compact pages; an index-only scan reads the heap only for pages not
-- yet all-visible (chunks written since the last (auto)vacuum).
--
-- A plain CREATE INDEX: while it builds (about a minute per million chunks) chunk writes
-- wait, searches do not. Queued behind a long writer of the table, its lock would hold every
-- search up: the migration gives up after 10 s instead (rolled back whole; run `kb migrate`
-- again).
SET LOCAL lock_timeout = '10s';

CREATE INDEX knowledge_chunk_exact
    ON knowledge_chunk (tenant_id, document_id, version_number, embedding_model, chunk_id)
    INCLUDE (chunking_strategy, embedding_dimension, embedding)
    WHERE embedding_dimension <= 512;
