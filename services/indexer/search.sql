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
-- wanted, $8 keyword list wanted; from keyword_terms: $9 strict, $10 any_word, $11
-- rarest_word, $12 ranking, $13 lexemes; $14 keyword candidates of each kind (at least $4).
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
-- The keyword list, bounded in cost whatever the query: at most $14 candidates of each kind
-- are ranked. $9 to $13 come from keyword_terms; a NULL query matches nothing.
--
-- The chunks these principals may search: the tenant's, the current search version's, READ
-- by one of the principals, within the request's filters -- all before any LIMIT.
keyword_searchable AS NOT MATERIALIZED (
    SELECT c.document_id, c.version_number, c.chunk_id, c.heading_path, c.text,
           c.search_document
      FROM knowledge_chunk c
     WHERE $8::boolean
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
),
-- The candidates, at most $14 of each kind: chunks holding every word (as
-- websearch_to_tsquery reads the query); then, for a natural question that found fewer than
-- $4 of those, chunks holding any of its rarer words; then, still short, chunks holding the
-- rarest of its other words. Which $14 of more matches is up to the scan: the cap is what
-- bounds the cost of a query whose words are everywhere.
keyword_all_words AS MATERIALIZED (
    SELECT c.*
      FROM keyword_searchable c
     WHERE c.search_document @@ $9::tsquery
     LIMIT $14
),
keyword_any_word AS MATERIALIZED (
    SELECT c.*
      FROM keyword_searchable c
     WHERE (SELECT count(*) FROM keyword_all_words) < $4
       AND c.search_document @@ $10::tsquery
       AND NOT coalesce(c.search_document @@ $9::tsquery, false)
     LIMIT $14
),
keyword_candidate AS MATERIALIZED (
    SELECT a.* FROM keyword_all_words a
    UNION ALL
    SELECT y.* FROM keyword_any_word y
    UNION ALL
    (SELECT c.*
       FROM keyword_searchable c
      WHERE (SELECT count(*) FROM keyword_all_words)
            + (SELECT count(*) FROM keyword_any_word) < $4
        AND c.search_document @@ $11::tsquery
        AND NOT coalesce(c.search_document @@ $9::tsquery, false)
        AND NOT coalesce(c.search_document @@ $10::tsquery, false)
      LIMIT $14)
),
-- Read each candidate's tsvector once (decompressing it is most of the cost of a test
-- on it): ts_rank against the OR of the query's lexemes, and which of them it holds --
-- setweight marks the query's lexemes 'C' (chunks only carry A and B) and ts_filter keeps
-- those.
keyword_held AS MATERIALIZED (
    SELECT c.document_id, c.version_number, c.chunk_id, c.heading_path, c.text,
           coalesce(ts_rank(c.search_document, $12::tsquery, 32), 0) AS closeness,
           tsvector_to_array(ts_filter(setweight(c.search_document, 'C', $13::text[]), '{C}'))
               AS held
      FROM keyword_candidate c
),
-- Each lexeme of the query weighs by how rare it is among the candidates (BM25's idf over
-- the candidate set): "refund" among chunks that all say "policy" is what tells them apart.
keyword_weight AS MATERIALIZED (
    SELECT l.lexeme, ln(1 + (n.total - d.holding + 0.5) / (d.holding + 0.5)) AS weight
      FROM unnest($13::text[]) AS l(lexeme)
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
     LIMIT $4
),
ranked AS (
    SELECT 'vector' AS list,
           row_number() OVER (ORDER BY v.distance, v.document_id, v.chunk_id) AS rank,
           1 - v.distance AS score, NULL::float8 AS coverage,
           v.document_id, v.version_number, v.chunk_id, v.heading_path, v.text
      FROM vector_list v
    UNION ALL
    SELECT 'keyword' AS list,
           row_number() OVER (ORDER BY k.rank DESC, k.document_id, k.chunk_id) AS rank,
           k.rank AS score, k.coverage::float8 AS coverage,
           k.document_id, k.version_number, k.chunk_id, k.heading_path, k.text
      FROM keyword_list k
)
SELECT x.list, x.rank, x.score::float8 AS score, x.coverage, x.document_id, d.title,
       x.version_number, x.chunk_id, x.heading_path, x.text
  FROM ranked x
  JOIN document d ON d.tenant_id = $1 AND d.document_id = x.document_id
 ORDER BY x.list, x.rank;

-- name: search_vector_candidates
-- Vector mode: search_candidates' vector list alone -- the same text (a unit test holds
-- them equal), the same parameters $1 to $7 -- so that a vector search does not pay for
-- planning the keyword list.
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
)
SELECT 'vector' AS list,
       row_number() OVER (ORDER BY v.distance, v.document_id, v.chunk_id) AS rank,
       (1 - v.distance)::float8 AS score, NULL::float8 AS coverage,
       v.document_id, d.title, v.version_number, v.chunk_id, v.heading_path, v.text
  FROM vector_list v
  JOIN document d ON d.tenant_id = $1 AND d.document_id = v.document_id
 ORDER BY rank;

-- name: keyword_terms
-- The keyword list's queries, read before search_candidates in the same transaction so that
-- the planner of that statement sees them as values: it then knows from the statistics how
-- many chunks a query matches, and reads a query whose words are in most chunks by a scan
-- that stops at the cap instead of building the GIN index's bitmap of all the matches.
-- (The tenant's configuration and the statistics are not the chunks: search_candidates
-- still reads every chunk in one snapshot.) No row for an unknown tenant.
--
-- strict: websearch_to_tsquery's reading of the text (every word; "a phrase", -not, or);
-- NULL when it holds no lexeme (only stop words or punctuation).
-- any_word: for a natural question (no quotes, no leading minus, no lone "or"), the OR of
-- its lexemes estimated in at most $3 chunks (a common word like "how" or "policy" would
-- bring candidates from most of the table, crowding out the telling ones); NULL otherwise.
-- rarest_word: for a natural question, the rarest of its other lexemes, if any.
-- ranking: the OR of its lexemes, what ts_rank weighs the chunk's occurrences against.
-- lexemes: the lexemes of the text under the tenant's configuration (stop words dropped,
-- words stemmed); the ranking weighs each by its rarity.
--
-- How many chunks hold a lexeme is estimated from the statistics ANALYZE keeps on the
-- tsvector column (the fraction of rows holding each of the table's commonest lexemes; any
-- other lexeme is rarer than those); no statistics yet: every lexeme counts as rare.
-- $1 tenant, $2 query text, $3 keyword candidates of each kind.
WITH query AS (
    SELECT websearch_to_tsquery(t.text_search_config, $2::text) AS strict,
           tsvector_to_array(to_tsvector(t.text_search_config, $2::text)) AS lexemes,
           $2::text ~ '["]|(^|\s)-\S|(^|\s)[oO][rR](\s|$)' AS syntax
      FROM tenant t
     WHERE t.tenant_id = $1
),
common AS (
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
     WHERE c.oid = 'knowledge_chunk'::regclass
       AND e.lexeme IS NOT NULL
),
lexeme AS (
    SELECT l.lexeme,
           coalesce(m.estimated_chunks, 0) AS estimated_chunks,
           ('''' || replace(replace(l.lexeme, '\', '\\'), '''', '''''') || '''')::tsquery
               AS query
      FROM query q
     CROSS JOIN LATERAL unnest(q.lexemes) AS l(lexeme)
      LEFT JOIN common m ON m.lexeme = l.lexeme
),
rare AS (
    SELECT string_agg(l.query::text, ' | ') AS any_word
      FROM lexeme l
     WHERE l.estimated_chunks <= $3
),
rarest_common AS (
    SELECT (SELECT l.query::text
              FROM lexeme l
             WHERE l.estimated_chunks > $3
             ORDER BY l.estimated_chunks, l.lexeme
             LIMIT 1) AS rarest_word
)
SELECT CASE WHEN numnode(q.strict) > 0 THEN q.strict::text END AS strict,
       CASE WHEN NOT q.syntax THEN r.any_word END AS any_word,
       CASE WHEN NOT q.syntax THEN c.rarest_word END AS rarest_word,
       (SELECT string_agg(l.query::text, ' | ') FROM lexeme l) AS ranking,
       ARRAY(SELECT l.lexeme FROM lexeme l ORDER BY l.lexeme) AS lexemes
  FROM query q, rare r, rarest_common c;
