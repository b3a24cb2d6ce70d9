-- Search over the index (services/search/index_pg.py; specialised by search_sql.py).

-- name: export_snapshot
-- Hybrid search's snapshot, for the connection that reads its other list at the same time
-- (search_pg: SET TRANSACTION SNAPSHOT, first in that connection's REPEATABLE READ
-- transaction). Valid while this transaction lives; taken by this first statement.
SELECT pg_export_snapshot()

-- name: choose_vector_path
-- The vector list's path (search_sql.VectorPath): ANN when the principals $2 may read more
-- than $5 chunks of tenant $1's current search versions of model $3 (within the document
-- ids filter $4), else EXACT; and whether the tenant has a valid graph of its own ($6), which
-- the ANN path then walks with its own ef_search. search_paths keeps the answer a short while
-- and sets the transaction up for the path
-- (search_sql.vector_path_settings_sql). It reads the readable documents' chunk counts
-- (written by each switch) only until their running sum passes $5 -- the window emits row
-- by row, and EXISTS stops at the first row over -- so a principal who may read the whole
-- tenant costs $5 / (chunks per document) pointer rows, not the tenant's (an index-only scan
-- of migrations/0016's index). Hybrid's keyword list follows the same path
-- (searchable_chunks).
SELECT CASE WHEN EXISTS (
         SELECT 1
           FROM (SELECT sum(coalesce(s.chunk_count, 0)) OVER (ROWS UNBOUNDED PRECEDING) AS running
                   FROM document_search_version s
                  WHERE s.tenant_id = $1
                    AND s.embedding_model = $3
                    AND ($4::uuid[] IS NULL OR s.document_id = ANY ($4::uuid[]))
                    AND EXISTS (
                          SELECT 1
                            FROM document_acl a
                           WHERE a.tenant_id = s.tenant_id
                             AND a.document_id = s.document_id
                             AND a.permission = 'READ'
                             AND a.principal = ANY ($2::text[]))) r
          WHERE r.running > $5)
       THEN 'ann' ELSE 'exact' END AS path,
       -- The tenant's own graph (services/indexer/maintenance/tenant_graphs.py), valid: the planner
       -- walks it rather than its partition's (the smaller index).
       EXISTS (
         SELECT 1
           FROM pg_class c
           JOIN pg_index i ON i.indexrelid = c.oid
          WHERE c.relname = $6::text
            AND c.relnamespace = (SELECT k.relnamespace
                                    FROM pg_class k
                                   WHERE k.oid = 'knowledge_chunk'::regclass)
            AND i.indisvalid) AS tenant_graph

-- name: undo_vector_path
-- Back to the session's planner settings $1 (search_sql.PLANNER_SETTINGS), after the vector
-- path's: for the statements that follow the vector list in the same transaction (hybrid's
-- keyword list when no second connection was free; keyword_terms wants its generic plan).
SELECT set_config(name, reset_val, true)
  FROM pg_settings
 WHERE name = ANY ($1::text[])

-- name: searchable_chunks
-- The chunks principals $2 may search in tenant $1 -- the current search version's, READ by
-- one of them, within the request's filters ($3 document ids, NULL: all; $4 heading path
-- prefix, NULL: all) -- for both lists, which include it as a NOT MATERIALIZED CTE: the
-- planner folds it into each list's scan, so every filter applies before any LIMIT. (The
-- exact vector list reads its twin, searchable_chunks_listed: the same chunks.)
--
-- The probe marker comment in each EXISTS below is where search_sql writes an OFFSET of 0
-- into the keyword list of principals who may read most of the tenant (the ANN path): an
-- EXISTS with an OFFSET stays a subquery run per candidate, after the full-text index has
-- found the candidate. Joined instead,
-- the planner estimates the tenant's readable documents at a hundredth of what they are
-- (it takes document ids to be independent of the tenant), starts from them and tests
-- every chunk of the tenant: 30 ms instead of 10 on the 1M bench. For principals who read
-- little, starting from their documents is right, and the text stays as it is.
SELECT c.document_id, c.version_number, c.chunk_id, c.heading_path, c.text,
       c.search_document, c.embedding
  FROM knowledge_chunk c
 WHERE c.tenant_id = $1
   AND c.embedding_model = 'search-template-model'
   AND ($3::uuid[] IS NULL OR c.document_id = ANY ($3::uuid[]))
   AND ($4::text[] IS NULL OR c.heading_path[1:cardinality($4::text[])] = $4::text[])
   -- The chunk belongs to its document's current search version (same model, same
   -- chunking strategy) ...
   AND EXISTS (
         SELECT 1
           FROM document_search_version s
          WHERE s.tenant_id = c.tenant_id
            AND s.document_id = c.document_id
            AND s.version_number = c.version_number
            AND s.embedding_model = 'search-template-model'
            AND s.chunking_strategy = c.chunking_strategy /*probe*/)
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
            AND a.principal = ANY ($2::text[]) /*probe*/)

-- name: searchable_chunks_listed
-- searchable_chunks as the exact vector list reads them (search_sql swaps it in for that
-- path): the same chunks, the readable documents listed first. The documents principals $2
-- may READ go in as one array, and one index-only scan of the tenant's search pointers
-- (migrations/0016) yields their current versions; each version's chunks are then read by
-- primary key. Probing each readable document's pointer from its ACL row instead (the EXISTS
-- of searchable_chunks, which the ANN path needs: a probe per graph candidate) cost a
-- descent and a heap page per document (1M bench, typical user, ~260 documents: the exact
-- list 11.6 -> 9.9 ms p50). The array is an uncorrelated subquery: read once per statement;
-- it holds only the documents of the request's filter $3, if any (a broad reader who
-- filters to a few documents takes this path: the array stays that small).
-- The keyword list keeps searchable_chunks on every path (with the list: slower for the
-- typical user, its plan no longer starting from the full-text index's matches).
SELECT c.document_id, c.version_number, c.chunk_id, c.heading_path, c.text,
       c.search_document, c.embedding
  FROM knowledge_chunk c
 WHERE c.tenant_id = $1
   AND c.embedding_model = 'search-template-model'
   AND ($3::uuid[] IS NULL OR c.document_id = ANY ($3::uuid[]))
   AND ($4::text[] IS NULL OR c.heading_path[1:cardinality($4::text[])] = $4::text[])
   AND EXISTS (
         SELECT 1
           FROM document_search_version s
          WHERE s.tenant_id = c.tenant_id
            AND s.document_id = c.document_id
            AND s.version_number = c.version_number
            AND s.embedding_model = 'search-template-model'
            AND s.chunking_strategy = c.chunking_strategy
            AND s.document_id = ANY (ARRAY(
                  SELECT a.document_id
                    FROM document_acl a
                   WHERE a.tenant_id = $1
                     AND a.permission = 'READ'
                     AND a.principal = ANY ($2::text[])
                     AND ($3::uuid[] IS NULL OR a.document_id = ANY ($3::uuid[])))))
   -- The model's dimension (search_sql writes it; a model has one): what lets the planner
   -- see that migrations/0017's index, of models of up to 512 dimensions, holds these chunks.
   AND c.embedding_dimension = 1

-- name: vector_list
-- The vector list of search_vector_candidates: the $5 searchable chunks ($1 to $4, as
-- searchable_chunks) nearest to the query vector $6.
--
-- The ANN path's: ordered by the model's HNSW expression, which only the tenant
-- partition's part of the model's index serves (search_pg's custom plans see the tenant as
-- a value and prune to its partition, migrations/0014). The exact path reads
-- vector_list_exact instead (search_sql swaps it in): every readable chunk ranked, recall 1
-- -- what it does when the principals may read few enough chunks that ranking them all is
-- cheaper than walking the graph past the others.
WITH searchable AS NOT MATERIALIZED (
    -- include: searchable_chunks
)
SELECT c.document_id, c.version_number, c.chunk_id, c.heading_path, c.text,
       (c.embedding::vector(1)) <=> $6::vector AS distance
  FROM searchable c
 ORDER BY (c.embedding::vector(1)) <=> $6::vector
 LIMIT $5

-- name: vector_list_exact
-- vector_list on the exact path (search_sql swaps it in): every chunk the principals may
-- read, ranked by distance to the query vector $6 -- each read from its entry in
-- migrations/0017's index, which INCLUDEs the chunking strategy, dimension and vector,
-- rather than from its row: an index-only scan, ~5 vectors to a leaf page where a 3.2 kB row
-- fills half a heap page (1M bench, typical user, ~2,600 chunks ranked: the vector search
-- 11.5 -> 9.4 ms p50; models of up to 512 dimensions, which that index holds). Only the $5 nearest are then read from
-- their rows, for their heading path and text. The heading-prefix filter $4 needs the row:
-- with it, the readable rows are read.
WITH searchable AS NOT MATERIALIZED (
    -- include: searchable_chunks_listed
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
   AND c.embedding_model = 'search-template-model'
   AND c.chunk_id = n.chunk_id

-- name: search_keyword_candidates
-- The keyword list: the $5 chunks that best match the query's words among those the
-- principals $2 may read in tenant $1. Read in the search's REPEATABLE READ transaction,
-- with the vector list (search_vector_candidates) when hybrid: both see one snapshot, so a
-- search running across a search-pointer switch sees each document at its old or its new
-- version, never both.
--
-- This text is a template (search_sql.TEMPLATE_MODEL), as vector_list is.
--
-- $1 tenant, $2 principals, $3 document ids filter (NULL: all), $4 heading path prefix
-- (NULL: all), $5 depth of the list; from keyword_terms: $6 strict, $7 any_word, $8
-- rarest_word, $9 ranking, $10 lexemes; $11 keyword candidates of each kind (at least $5).
WITH
-- $7 and $8 typed even where search_sql left out the kinds that read them (never read).
keyword_term_types AS (SELECT $7::tsquery AS any_word, $8::tsquery AS rarest_word),
-- The keyword list, bounded in cost whatever the query: at most $11 candidates of each kind
-- are ranked. $6 to $10 come from keyword_terms; a NULL query matches nothing.
keyword_searchable AS NOT MATERIALIZED (
    -- include: searchable_chunks
),
-- The candidates, at most $11 of each kind: chunks holding every word (as
-- websearch_to_tsquery reads the query); then, for a natural question that found fewer than
-- $5 of those, chunks holding any of its rarer words; then, still short, chunks holding the
-- rarest of its other words -- only as many as fill the list to its depth $5: that word is a
-- common one (more than $11 chunks), so its matches are tested chunk by chunk, and ranking
-- $11 of them cost a test of every chunk the principals may read (1M bench, typical user:
-- the keyword list 11.8 -> 6.9 ms p50; no change on either quality set). Which $11 of more
-- matches is up to the scan: the cap is what bounds the cost of a query whose words are
-- everywhere.
keyword_all_words AS MATERIALIZED (
    SELECT c.*
      FROM keyword_searchable c
     WHERE c.search_document @@ $6::tsquery
     LIMIT $11
),
-- (Each later kind is a CTE of its own: search_sql leaves out the body of one the query's
-- terms cannot fill, keyword_no_candidates.)
keyword_any_word AS MATERIALIZED (
    SELECT c.*
      FROM keyword_searchable c
     WHERE (SELECT count(*) FROM keyword_all_words) < $5
       AND c.search_document @@ $7::tsquery
       AND NOT coalesce(c.search_document @@ $6::tsquery, false)
     LIMIT $11
),
keyword_rarest_word AS MATERIALIZED (
    SELECT c.*
      FROM keyword_searchable c
     WHERE (SELECT count(*) FROM keyword_all_words)
           + (SELECT count(*) FROM keyword_any_word) < $5
       AND c.search_document @@ $8::tsquery
       AND NOT coalesce(c.search_document @@ $6::tsquery, false)
       AND NOT coalesce(c.search_document @@ $7::tsquery, false)
     LIMIT greatest(0, $5 - (SELECT count(*) FROM keyword_all_words)
                          - (SELECT count(*) FROM keyword_any_word))
),
keyword_candidate AS MATERIALIZED (
    SELECT a.* FROM keyword_all_words a
    UNION ALL
    SELECT y.* FROM keyword_any_word y
    UNION ALL
    SELECT r.* FROM keyword_rarest_word r
),
-- Read each candidate's tsvector once (decompressing it is most of the cost of a test
-- on it): ts_rank against the OR of the query's lexemes, and which of them it holds --
-- setweight marks the query's lexemes 'C' (chunks only carry A and B) and ts_filter keeps
-- those.
keyword_held AS MATERIALIZED (
    SELECT c.document_id, c.version_number, c.chunk_id, c.heading_path, c.text,
           coalesce(ts_rank(c.search_document, $9::tsquery, 32), 0) AS closeness,
           tsvector_to_array(ts_filter(setweight(c.search_document, 'C', $10::text[]), '{C}'))
               AS held
      FROM keyword_candidate c
),
-- Each lexeme of the query weighs by how rare it is among the candidates (BM25's idf over
-- the candidate set): "refund" among chunks that all say "policy" is what tells them apart.
keyword_weight AS MATERIALIZED (
    SELECT l.lexeme, ln(1 + (n.total - d.holding + 0.5) / (d.holding + 0.5)) AS weight
      FROM unnest($10::text[]) AS l(lexeme)
     CROSS JOIN (SELECT count(*) AS total FROM keyword_held) n
     CROSS JOIN LATERAL (SELECT count(*) AS holding
                           FROM keyword_held h
                          WHERE l.lexeme = ANY (h.held)) d
),
-- The score: the weights of the query's lexemes the chunk holds, plus how often and where
-- it holds them (ts_rank against their OR, normalised into [0, 1); a heading weighs more
-- than text) as the finer order. Not ts_rank_cd, nor ts_rank against the AND: both walk
-- every position of every word, 10-20x the cost on chunks full of common words.
-- coverage: the share of the weight of all the query's lexemes that the chunk holds (a word
-- no candidate holds weighs most); hybrid search fuses only chunks covering enough of it.
keyword_list AS (
    SELECT h.document_id, h.version_number, h.chunk_id, h.heading_path, h.text,
           m.matched + h.closeness AS rank,
           m.matched / nullif(t.total, 0) AS coverage
      FROM keyword_held h
     CROSS JOIN (SELECT sum(w.weight) AS total FROM keyword_weight w) t
     CROSS JOIN LATERAL (SELECT coalesce(sum(w.weight), 0) AS matched
                           FROM keyword_weight w
                          WHERE w.lexeme = ANY (h.held)) m
     ORDER BY rank DESC, h.document_id, h.chunk_id
     LIMIT $5
)
SELECT 'keyword' AS list,
       row_number() OVER (ORDER BY k.rank DESC, k.document_id, k.chunk_id) AS rank,
       k.rank::float8 AS score, k.coverage::float8 AS coverage,
       k.document_id, d.title, k.version_number, k.chunk_id, k.heading_path, k.text
  FROM keyword_list k
  JOIN document d ON d.tenant_id = $1 AND d.document_id = k.document_id
 ORDER BY rank;

-- name: keyword_no_candidates
-- The body of search_keyword_candidates' keyword_any_word or keyword_rarest_word when the
-- query has no such word ($7 or $8 NULL, so that kind would find nothing; search_sql swaps
-- it in): no rows, of searchable_chunks' columns, and nothing for the planner to plan. The
-- keyword list is planned for each search (its terms as values, keyword_terms), and each
-- kind's scan with its version and ACL probes cost ~0.7 ms of it even when a NULL term made
-- its filter false (1M bench, typical user: planning 3.1 -> 2.4 ms p50 for the queries
-- without a rarer word; 3.40 -> 3.08 ms mean over all 200; the same rows).
SELECT NULL::uuid AS document_id, NULL::integer AS version_number, NULL::text AS chunk_id,
       NULL::text[] AS heading_path, NULL::text AS text, NULL::tsvector AS search_document,
       NULL::vector AS embedding
 WHERE false

-- name: search_vector_candidates
-- The vector list (vector_list), with each document's title. $1 tenant, $2 principals, $3
-- document ids filter (NULL: all), $4 heading path prefix (NULL: all), $5 depth, $6 query
-- vector. In hybrid search it runs beside search_keyword_candidates, on another connection
-- in the same snapshot (search_pg: export_snapshot): one snapshot for both lists.
WITH vector_list AS (
    -- include: vector_list
)
SELECT 'vector' AS list,
       row_number() OVER (ORDER BY v.distance, v.document_id, v.chunk_id) AS rank,
       (1 - v.distance)::float8 AS score, NULL::float8 AS coverage,
       v.document_id, d.title, v.version_number, v.chunk_id, v.heading_path, v.text
  FROM vector_list v
  JOIN document d ON d.tenant_id = $1 AND d.document_id = v.document_id
 ORDER BY rank;

-- name: tenant_partition
-- The partition of knowledge_chunk holding tenant $1's chunks (a hash of the tenant: it never
-- changes, search_pg caches it); no row while the tenant has no chunk.
SELECT c.relname AS partition
  FROM pg_class c
 WHERE c.oid = (SELECT k.tableoid FROM knowledge_chunk k WHERE k.tenant_id = $1 LIMIT 1)

-- name: keyword_terms
-- The query's words (services/search/keyword_terms.py chooses from them the keyword list's
-- terms), read before search_keyword_candidates in the same transaction so that the planner
-- of that statement sees the terms as values: it then knows from the statistics how many
-- chunks a query matches, and reads a query whose words are in most chunks by a scan that
-- stops at the cap instead of building the GIN index's bitmap of all the matches. No row for
-- an unknown tenant. $1 tenant, $2 query text.
--
-- strict: websearch_to_tsquery's reading of the text (every word; "a phrase", -not, or);
-- NULL when it holds no lexeme (only stop words or punctuation).
-- natural: no quotes, no leading minus, no lone "or".
-- lexemes: the lexemes of the text under the tenant's configuration (stop words dropped,
-- words stemmed), in the database's order; queries: each as a tsquery of it alone.
--
-- It sets up the planner for what follows in the transaction: custom plans
-- (search_keyword_candidates must be planned with the terms as values); hash and merge
-- joins off, as the vector list's paths have them (search_sql.vector_path_settings_sql);
-- and, as there too, no parallel plans, which the planner would cost out for every scan of
-- a list that never takes one.
-- The planner takes the readable documents for a hundredth of what they are (it takes
-- document ids to be independent of the tenant); free to hash them, it joined the tenant's
-- pointers with them and tested every readable chunk's tsvector, where a nested loop starts
-- from the full-text index's matches and probes each one's pointer and ACL (1M bench,
-- typical user, once migrations/0016's covering index made the pointers cheap to read in
-- full: 13.2 ms p50 instead of 7.9; the same either way for the whole tenant and the
-- narrow principal).
WITH query AS (
    SELECT websearch_to_tsquery(t.text_search_config, $2::text) AS strict,
           tsvector_to_array(to_tsvector(t.text_search_config, $2::text)) AS lexemes,
           $2::text ~ '["]|(^|\s)-\S|(^|\s)[oO][rR](\s|$)' AS syntax
      FROM tenant t
     WHERE t.tenant_id = $1
)
-- Both arrays follow one numbering of the lexemes (the database's order).
SELECT CASE WHEN numnode(q.strict) > 0 THEN q.strict::text END AS strict,
       NOT q.syntax AS natural,
       coalesce(w.lexemes, '{}') AS lexemes,
       coalesce(w.queries, '{}') AS queries,
       set_config('plan_cache_mode', 'force_custom_plan', true) AS plan_cache_mode,
       set_config('enable_hashjoin', 'off', true) AS enable_hashjoin,
       set_config('enable_mergejoin', 'off', true) AS enable_mergejoin,
       set_config('max_parallel_workers_per_gather', '0', true) AS parallel_workers
  FROM query q
 CROSS JOIN LATERAL (
        SELECT array_agg(n.lexeme ORDER BY n.position) AS lexemes,
               array_agg(('''' || replace(replace(n.lexeme, '\', '\\'), '''', '''''') || '''')
                             ::tsquery::text
                         ORDER BY n.position) AS queries
          FROM (SELECT l.lexeme, row_number() OVER (ORDER BY l.lexeme) AS position
                  FROM unnest(q.lexemes) AS l(lexeme)) n) w;

-- name: partition_common_lexemes
-- The commonest lexemes of a partition of knowledge_chunk ($1, the tenant's:
-- tenant_partition) and how many chunks each is estimated to be in, from the statistics
-- ANALYZE keeps on its tsvector column (the fraction of rows holding each; any other lexeme
-- is rarer). Per partition because ANALYZE keeps them so (autovacuum's never visits the
-- partitioned table itself), and the partition is what the keyword list reads; by name, so
-- that both catalog lookups are index probes. No rows before the partition's first ANALYZE.
-- Kept a while per partition (keyword_terms.PartitionStatistics): reading them costs more
-- than the rest of a search's terms.
SELECT e.lexeme, e.fraction * greatest(c.reltuples, 0) AS estimated_chunks
  FROM pg_class c
  JOIN pg_namespace n ON n.oid = c.relnamespace
  JOIN pg_stats s
    ON s.schemaname = n.nspname
   AND s.tablename = c.relname
   AND s.attname = 'search_document'
   AND NOT s.inherited
 CROSS JOIN LATERAL unnest(s.most_common_elems::text::text[], s.most_common_elem_freqs)
            AS e(lexeme, fraction)
 WHERE c.relname = $1::text
   AND c.relnamespace = (SELECT k.relnamespace
                           FROM pg_class k
                          WHERE k.oid = 'knowledge_chunk'::regclass)
   AND e.lexeme IS NOT NULL
