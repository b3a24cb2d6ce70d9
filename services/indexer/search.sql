-- Search over the index (services/indexer/search_pg.py).

-- name: configure_search_transaction
-- Run first in search's short read-only transaction; every setting is LOCAL to it.
-- pgvector >= 0.8 iterative index scans: when the tenant, version and ACL filters reject
-- most of what the HNSW scan yields, the scan goes on (up to hnsw.max_scan_tuples) instead
-- of returning fewer than LIMIT rows. relaxed_order may hand rows back slightly out of
-- distance order; the statement re-ranks them by distance anyway.
-- force_custom_plan: a generic plan would not see the LIMIT's value (and guesses 10% of
-- the table), which can price the HNSW scan out; planning this statement costs little.
SELECT set_config('hnsw.iterative_scan', 'relaxed_order', true),
       set_config('hnsw.ef_search', $1::integer::text, true),
       set_config('hnsw.max_scan_tuples', $2::integer::text, true),
       set_config('plan_cache_mode', 'force_custom_plan', true);

-- name: search_candidates
-- Both ranked lists in ONE statement, so both read one snapshot: a search running across a
-- search-pointer switch sees each document at its old or its new version, never both.
--
-- This text is a template written for a placeholder model (search_pg.TEMPLATE_MODEL) of
-- dimension 1: search_pg replaces its model predicates and vector expression (built by
-- ann_index) with the real model's, as literals, and caches the result per model. The model's HNSW
-- index is partial (WHERE embedding_model = '<model>') over the expression
-- (embedding::vector(<dim>)): only a query with that very predicate and expression in its
-- text can use it; with a bind parameter the planner could not prove the partial predicate.
--
-- $1 tenant, $2 principals, $3 query vector (NULL in keyword mode), $4 depth of each list,
-- $5 document ids filter (NULL: all), $6 heading path prefix (NULL: all), $7 vector list
-- wanted, $8 keyword list wanted, $9 query text.
WITH vector_list AS (
    SELECT c.document_id, c.version_number, c.chunk_id, c.heading_path, c.text,
           (c.embedding::vector(1)) <=> $3::vector AS distance
      FROM knowledge_chunk c
     WHERE $7::boolean
       AND c.tenant_id = $1
       AND c.embedding_model = 'search-template-model'
       AND ($5::uuid[] IS NULL OR c.document_id = ANY ($5::uuid[]))
       AND ($6::text[] IS NULL OR c.heading_path[1:cardinality($6::text[])] = $6::text[])
       -- The chunk belongs to its document's current search version (same model, same
       -- chunking strategy) ...
       AND EXISTS (
             SELECT 1
               FROM document_search_version s
              WHERE s.tenant_id = c.tenant_id
                AND s.document_id = c.document_id
                AND s.version_number = c.version_number
                AND s.embedding_model = 'search-template-model'
                AND s.chunking_strategy = c.chunking_strategy)
       -- ... and these principals may READ the document. Both are filters of the scan,
       -- before the LIMIT: an HNSW scan probes them per candidate (two primary-key
       -- lookups) and, iterating, goes on until it has $4 rows that pass; a selective ACL
       -- lets the planner start from the ACL instead and rank that document set exactly.
       AND EXISTS (
             SELECT 1
               FROM document_acl a
              WHERE a.tenant_id = c.tenant_id
                AND a.document_id = c.document_id
                AND a.permission = 'READ'
                AND a.principal = ANY ($2::text[]))
     ORDER BY (c.embedding::vector(1)) <=> $3::vector
     LIMIT $4
),
keyword_list AS (
    SELECT c.document_id, c.version_number, c.chunk_id, c.heading_path, c.text,
           ts_rank_cd(c.search_document, q.query) AS rank
      FROM knowledge_chunk c,
           -- The tenant's configuration; an unknown tenant gives NULL, which matches nothing.
           (SELECT websearch_to_tsquery(
                       (SELECT t.text_search_config FROM tenant t WHERE t.tenant_id = $1),
                       $9::text) AS query) q
     WHERE $8::boolean
       AND c.search_document @@ q.query
       AND c.tenant_id = $1
       AND c.embedding_model = 'search-template-model'
       AND ($5::uuid[] IS NULL OR c.document_id = ANY ($5::uuid[]))
       AND ($6::text[] IS NULL OR c.heading_path[1:cardinality($6::text[])] = $6::text[])
       AND EXISTS (
             SELECT 1
               FROM document_search_version s
              WHERE s.tenant_id = c.tenant_id
                AND s.document_id = c.document_id
                AND s.version_number = c.version_number
                AND s.embedding_model = 'search-template-model'
                AND s.chunking_strategy = c.chunking_strategy)
       AND EXISTS (
             SELECT 1
               FROM document_acl a
              WHERE a.tenant_id = c.tenant_id
                AND a.document_id = c.document_id
                AND a.permission = 'READ'
                AND a.principal = ANY ($2::text[]))
     ORDER BY rank DESC, c.document_id, c.chunk_id
     LIMIT $4
),
ranked AS (
    SELECT 'vector' AS list,
           row_number() OVER (ORDER BY v.distance, v.document_id, v.chunk_id) AS rank,
           1 - v.distance AS score,
           v.document_id, v.version_number, v.chunk_id, v.heading_path, v.text
      FROM vector_list v
    UNION ALL
    SELECT 'keyword' AS list,
           row_number() OVER (ORDER BY k.rank DESC, k.document_id, k.chunk_id) AS rank,
           k.rank AS score,
           k.document_id, k.version_number, k.chunk_id, k.heading_path, k.text
      FROM keyword_list k
)
SELECT x.list, x.rank, x.score::float8 AS score, x.document_id, d.title, x.version_number,
       x.chunk_id, x.heading_path, x.text
  FROM ranked x
  JOIN document d ON d.tenant_id = $1 AND d.document_id = x.document_id
 ORDER BY x.list, x.rank;
