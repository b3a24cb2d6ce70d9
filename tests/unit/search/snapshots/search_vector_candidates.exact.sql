-- The vector list, with each document's title and its version's media type (the stored
-- upload's: read here, for the list's $5 rows only, by primary key). $1 tenant, $2 principals, $3 document ids
-- filter (NULL: all), $4 heading path prefix (NULL: all), $5 depth, $6 query vector. In
-- hybrid search it runs beside search_keyword_candidates, on another connection in the same
-- snapshot (index_pg: export_snapshot): one snapshot for both lists. The list is the vector
-- path's (slot vector_list): vector_list_ann or vector_list_exact.
WITH vector_list AS (
    -- slot vector_list: vector_list_exact
    -- The vector list on the exact path: every chunk the principals may read, ranked by distance
    -- to the query vector $6, recall 1 -- the path of principals who may read few enough chunks
    -- that ranking them all is cheaper than walking the graph past the others. Each is read from
    -- its entry in migrations/0017's index, which INCLUDEs the chunking strategy, dimension and
    -- vector, rather than from its row: an index-only scan, a leaf page holding several vectors
    -- where a chunk's row (its text and tsvector too) takes a large share of a heap page (models
    -- of up to 512 dimensions, which that index holds). Only the $5 nearest are then read from
    -- their rows, for their heading path and text. The heading-prefix filter $4 needs the row:
    -- with it, the readable rows are read.
    WITH searchable AS NOT MATERIALIZED (
        -- searchable_chunks as the exact vector list reads them: the same chunks, the readable
        -- documents listed first. The documents principals $2 may READ go in as one array, and one
        -- index-only scan of the tenant's search pointers (migrations/0016) yields their current
        -- versions; each version's chunks are then read by primary key. Probing each readable
        -- document's pointer from its ACL row instead (the EXISTS of searchable_chunks, which the
        -- ANN path needs: a probe per graph candidate) costs a descent and a heap page per
        -- document. The array is an uncorrelated subquery: read once per statement; it holds only
        -- the documents of the request's filter $3, if any (a broad reader who filters to a few
        -- documents takes this path: the array stays that small).
        -- The keyword list keeps searchable_chunks on every path (with the list: slower for the
        -- typical user, its plan no longer starting from the full-text index's matches).
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
                    AND s.document_id = ANY (ARRAY(
                          SELECT a.document_id
                            FROM document_acl a
                           WHERE a.tenant_id = $1
                             AND a.permission = 'READ'
                             AND a.principal = ANY ($2::text[])
                             AND ($3::uuid[] IS NULL OR a.document_id = ANY ($3::uuid[]))))
               )
           -- The model's dimension (slot chunk_dimension; a model has one): what lets the planner
           -- see that migrations/0017's index, of models of up to 512 dimensions, holds these chunks.
           AND c.embedding_dimension = 384
    ),
    nearest AS MATERIALIZED (
        SELECT c.document_id, c.version_number, c.chunk_id, c.embedding <=> $6::vector AS distance
          FROM searchable c
         ORDER BY c.embedding <=> $6::vector
         LIMIT $5
    )
    SELECT n.document_id, n.version_number, n.chunk_id, c.heading_path, c.text, n.distance
      FROM nearest n
      JOIN knowledge_chunk c
        ON c.tenant_id = $1
       AND c.document_id = n.document_id
       AND c.version_number = n.version_number
       AND c.embedding_model = 'all-MiniLM-L6-v2-onnx-int8'
       AND c.chunk_id = n.chunk_id
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
