-- The vector list, with each document's title and its version's media type (the stored
-- upload's: read here, for the list's $5 rows only, by primary key). $1 tenant, $2 principals, $3 document ids
-- filter (NULL: all), $4 heading path prefix (NULL: all), $5 depth, $6 query vector. In
-- hybrid search it runs beside search_keyword_candidates, on another connection in the same
-- snapshot (index_pg: export_snapshot): one snapshot for both lists. The list is the vector
-- path's (slot vector_list): vector_list_ann or vector_list_exact.
WITH vector_list AS (
    -- slot vector_list: vector_list_ann
    -- The vector list on the ANN path: the $5 searchable chunks ($1 to $4, as
    -- searchable_chunks) nearest to the query vector $6, ordered by the model's HNSW expression
    -- (slot chunk_vector), which the tenant's own graph serves, or, where the indexers build
    -- them (KB_INDEXER_PARTITION_GRAPHS), the tenant partition's part of the model's index (the
    -- path's custom plans, statements.vector_path_settings_sql, see the tenant as a value and
    -- prune to its partition, migrations/0014). Taken only when one of them is valid
    -- (search.sql: choose_vector_path).
    WITH searchable AS NOT MATERIALIZED (
        -- The chunks principals $2 may search in tenant $1 -- the current search version's, READ by
        -- one of them, within the request's filters -- for the keyword list on every path and the
        -- vector list on the ANN path, which include it as a NOT MATERIALIZED CTE: the planner folds
        -- it into each list's scan, so every filter applies before any LIMIT. (The exact vector list
        -- reads its twin, searchable_chunks_listed: the same chunks.)
        --
        -- The keyword list of principals who may read most of the tenant (the ANN path) ends each
        -- EXISTS with an OFFSET of 0 (slot probe: probe_each_candidate): an EXISTS with an OFFSET
        -- stays a subquery run per candidate, after the full-text index has found the candidate.
        -- Joined instead, the planner estimates the tenant's readable documents at a hundredth of
        -- what they are (it takes document ids to be independent of the tenant), starts from them
        -- and tests every chunk of the tenant, which costs such principals far more than a probe per
        -- candidate. For principals who read little, starting from their documents is right, and
        -- the slots stay empty.
        -- What searchable_chunks and searchable_chunks_listed begin with: tenant $1's chunks of the
        -- model (slot chunk_model) within the request's filters ($3 document ids, NULL: all; $4
        -- heading path prefix, NULL: all). Each goes on with the rest of its WHERE.
        SELECT c.document_id, c.version_number, c.chunk_id, c.heading_path, c.text,
               c.search_document, c.embedding
          FROM knowledge_chunk c
         WHERE c.tenant_id = $1
           AND c.embedding_model = 'all-MiniLM-L6-v2-onnx-int8'
           AND ($3::uuid[] IS NULL OR c.document_id = ANY ($3::uuid[]))
           AND ($4::text[] IS NULL OR c.heading_path[1:cardinality($4::text[])] = $4::text[])
           -- The chunk belongs to its document's current search version (same model, same
           -- chunking strategy) ...
           AND EXISTS (
                 -- The EXISTS of searchable_chunks and searchable_chunks_listed that keeps a chunk c of its
                 -- document's current search version: the same version, model (slot pointer_model) and
                 -- chunking strategy. Each goes on with the rest of its WHERE.
                 SELECT 1
                   FROM document_search_version s
                  WHERE s.tenant_id = c.tenant_id
                    AND s.document_id = c.document_id
                    AND s.version_number = c.version_number
                    AND s.embedding_model = 'all-MiniLM-L6-v2-onnx-int8'
                    AND s.chunking_strategy = c.chunking_strategy
               )
           -- ... and these principals may READ the document. An HNSW scan probes both per
           -- candidate (two primary-key lookups) and, iterating, goes on until it has its LIMIT of
           -- rows that pass; the keyword list starts from the ACL or the full-text index's matches,
           -- whichever the planner estimates cheaper (the exact vector list lists the readable
           -- documents first: searchable_chunks_listed).
           AND EXISTS (
                 SELECT 1
                   FROM document_acl a
                  WHERE a.tenant_id = c.tenant_id
                    AND a.document_id = c.document_id
                    AND a.permission = 'READ'
                    AND a.principal = ANY ($2::text[])
               )
    )
    SELECT c.document_id, c.version_number, c.chunk_id, c.heading_path, c.text,
           (c.embedding::vector(384))
               <=> $6::vector AS distance
      FROM searchable c
     ORDER BY
           (c.embedding::vector(384))
               <=> $6::vector
     LIMIT $5
)
SELECT 'vector' AS list,
       row_number() OVER (ORDER BY v.distance, v.document_id, v.chunk_id) AS rank,
       (1 - v.distance)::float8 AS score, NULL::float8 AS coverage,
       v.document_id, d.title, dv.media_type, v.version_number, v.chunk_id, v.heading_path,
       v.text
  FROM vector_list v
  JOIN document d ON d.tenant_id = $1 AND d.document_id = v.document_id
  JOIN document_version dv
    ON dv.tenant_id = $1 AND dv.document_id = v.document_id
   AND dv.version_number = v.version_number
 ORDER BY rank
