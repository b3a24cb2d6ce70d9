-- Search chooses the vector list's path from how many chunks the caller's principals may
-- read (services/indexer/search.sql: choose_vector_path): a running sum of the readable
-- documents' chunk counts over the tenant's search pointers, in document order, that stops
-- once it passes the limit. The primary key finds the tenant's pointers, but each is read
-- from the heap, one page apiece (pointers are written document by document, across
-- tenants): ~1 ms of the ~2 ms that choice took for a tenant of 1,000 documents (1M
-- bench). This index holds everything the sum reads, in document order: an index-only
-- scan, merged with the ACL index's document order (~1 ms).
CREATE INDEX document_search_version_readable
    ON document_search_version (tenant_id, embedding_model, document_id)
    INCLUDE (chunk_count);
