-- The search's two candidate statements, search_vector_candidates and
-- search_keyword_candidates, in named fragments: statements.py assembles one text from them
-- per embedding model, vector path and (the keyword list) kinds of candidates
-- (specialised_search_sql); tests/unit/search/snapshots/ holds each text it assembles.
--
-- Two kinds of line stand for a fragment, which takes the line's place indented as it is:
--   -- include: <fragment>   always that fragment of this file: services/runtime/pg/sql.py puts
--                            it in as the file is read, as in every .sql file;
--   -- slot: <slot>          what the statement's variant puts there (statements.py):
--                            vector_list, probe, keyword_any_word, keyword_rarest_word: a
--                            fragment of this file chosen per path or kinds of candidates,
--                            or nothing (statements.slot_choices); chunk_model,
--                            pointer_model, chunk_dimension, chunk_vector: the model's
--                            literals (services/index/ann.py), which its partial indexes
--                            need to see in the text.
-- The assembled text marks each chosen fragment with a comment, "-- slot <slot>: <fragment>".
--
-- Not a .sql file: the named queries of every .sql file under services are prepared as they
-- are (tests/integration/test_migrations.py), and these are parts of statements; every
-- statement assembled from them is prepared there instead.

-- name: search_vector_candidates
-- The vector list, with each document's title and its version's media type (the stored
-- upload's: read here, for the list's $5 rows only, by primary key). $1 tenant, $2 principals, $3 document ids
-- filter (NULL: all), $4 heading path prefix (NULL: all), $5 depth, $6 query vector. In
-- hybrid search it runs beside search_keyword_candidates, on another connection in the same
-- snapshot (index_pg: export_snapshot): one snapshot for both lists. The list is the vector
-- path's (slot vector_list): vector_list_ann or vector_list_exact.
WITH vector_list AS (
    -- slot: vector_list
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
 ORDER BY rank;

-- name: vector_list_ann
-- The vector list on the ANN path: the $5 searchable chunks ($1 to $4, as
-- searchable_chunks) nearest to the query vector $6, ordered by the model's HNSW expression
-- (slot chunk_vector), which the tenant's own graph serves, or, where the indexers build
-- them (KB_INDEXER_PARTITION_GRAPHS), the tenant partition's part of the model's index (the
-- path's custom plans, statements.vector_path_settings_sql, see the tenant as a value and
-- prune to its partition, migrations/0014). Taken only when one of them is valid
-- (search.sql: choose_vector_path).
WITH searchable AS NOT MATERIALIZED (
    -- include: searchable_chunks
)
SELECT c.document_id, c.version_number, c.chunk_id, c.heading_path, c.text,
       -- slot: chunk_vector
           <=> $6::vector AS distance
  FROM searchable c
 ORDER BY
       -- slot: chunk_vector
           <=> $6::vector
 LIMIT $5

-- name: vector_list_exact
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
   -- slot: chunk_model
   AND c.chunk_id = n.chunk_id

-- name: filtered_chunks
-- What searchable_chunks and searchable_chunks_listed begin with: tenant $1's chunks of the
-- model (slot chunk_model) within the request's filters ($3 document ids, NULL: all; $4
-- heading path prefix, NULL: all). Each goes on with the rest of its WHERE.
SELECT c.document_id, c.version_number, c.chunk_id, c.heading_path, c.text,
       c.search_document, c.embedding
  FROM knowledge_chunk c
 WHERE c.tenant_id = $1
   -- slot: chunk_model
   AND ($3::uuid[] IS NULL OR c.document_id = ANY ($3::uuid[]))
   AND ($4::text[] IS NULL OR c.heading_path[1:cardinality($4::text[])] = $4::text[])

-- name: current_search_version
-- The EXISTS of searchable_chunks and searchable_chunks_listed that keeps a chunk c of its
-- document's current search version: the same version, model (slot pointer_model) and
-- chunking strategy. Each goes on with the rest of its WHERE.
SELECT 1
  FROM document_search_version s
 WHERE s.tenant_id = c.tenant_id
   AND s.document_id = c.document_id
   AND s.version_number = c.version_number
   -- slot: pointer_model
   AND s.chunking_strategy = c.chunking_strategy

-- name: searchable_chunks
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
-- include: filtered_chunks
   -- The chunk belongs to its document's current search version (same model, same
   -- chunking strategy) ...
   AND EXISTS (
         -- include: current_search_version
            -- slot: probe
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
            -- slot: probe
       )

-- name: probe_each_candidate
-- Keeps the EXISTS it ends a subquery run per candidate (searchable_chunks).
OFFSET 0

-- name: searchable_chunks_listed
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
-- include: filtered_chunks
   AND EXISTS (
         -- include: current_search_version
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
   -- slot: chunk_dimension

-- name: search_keyword_candidates
-- The keyword list: the $5 chunks that best match the query's words among those the
-- principals $2 may read in tenant $1. Read in the search's REPEATABLE READ transaction,
-- with the vector list (search_vector_candidates) when hybrid: both see one snapshot, so a
-- search running across a search-pointer switch sees each document at its old or its new
-- version, never both.
--
-- $1 tenant, $2 principals, $3 document ids filter (NULL: all), $4 heading path prefix
-- (NULL: all), $5 depth of the list; from keyword_terms: $6 strict, $7 any_word, $8
-- rarest_word, $9 ranking, $10 lexemes; $11 keyword candidates of each kind (at least $5).
WITH
-- $7 and $8 typed even where the statement leaves out the kinds that read them (never read).
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
-- $11 of them cost a test of every chunk the principals may read, for no better answers.
-- Which $11 of more matches is up to the scan: the cap is what bounds the cost of a query
-- whose words are everywhere.
keyword_all_words AS MATERIALIZED (
    SELECT c.*
      FROM keyword_searchable c
     WHERE c.search_document @@ $6::tsquery
     LIMIT $11
),
-- Each later kind is a CTE of its own, its body the kind's scan when the query's terms can
-- find that kind, else keyword_no_candidates (slots keyword_any_word, keyword_rarest_word).
keyword_any_word AS MATERIALIZED (
    -- slot: keyword_any_word
),
keyword_rarest_word AS MATERIALIZED (
    -- slot: keyword_rarest_word
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
-- every position of every word, which costs many times as much on chunks full of common
-- words.
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
       k.document_id, d.title, dv.media_type, k.version_number, k.chunk_id, k.heading_path,
       k.text
  FROM keyword_list k
  JOIN document d ON d.tenant_id = $1 AND d.document_id = k.document_id
  JOIN document_version dv
    ON dv.tenant_id = $1 AND dv.document_id = k.document_id
   AND dv.version_number = k.version_number
 ORDER BY rank;

-- name: keyword_any_word_candidates
-- The keyword list's second kind of candidates (slot keyword_any_word): chunks holding any
-- of the query's rarer words $7, when those holding every word were fewer than $5.
SELECT c.*
  FROM keyword_searchable c
 WHERE (SELECT count(*) FROM keyword_all_words) < $5
   AND c.search_document @@ $7::tsquery
   AND NOT coalesce(c.search_document @@ $6::tsquery, false)
 LIMIT $11

-- name: keyword_rarest_word_candidates
-- The keyword list's third kind of candidates (slot keyword_rarest_word): chunks holding the
-- rarest of the query's common words $8, as many as fill the list to its depth $5.
SELECT c.*
  FROM keyword_searchable c
 WHERE (SELECT count(*) FROM keyword_all_words)
       + (SELECT count(*) FROM keyword_any_word) < $5
   AND c.search_document @@ $8::tsquery
   AND NOT coalesce(c.search_document @@ $6::tsquery, false)
   AND NOT coalesce(c.search_document @@ $7::tsquery, false)
 LIMIT greatest(0, $5 - (SELECT count(*) FROM keyword_all_words)
                      - (SELECT count(*) FROM keyword_any_word))

-- name: keyword_no_candidates
-- The body of search_keyword_candidates' keyword_any_word or keyword_rarest_word when the
-- query has no such word ($7 or $8 NULL, so that kind would find nothing): no rows, of
-- searchable_chunks' columns, and nothing for the planner to plan. The keyword list is
-- planned for each search (its terms as values, keyword_terms), and each kind's scan, with
-- its version and ACL probes, took a share of that planning even when a NULL term made its
-- filter false.
SELECT NULL::uuid AS document_id, NULL::integer AS version_number, NULL::text AS chunk_id,
       NULL::text[] AS heading_path, NULL::text AS text, NULL::tsvector AS search_document,
       NULL::vector AS embedding
 WHERE false
