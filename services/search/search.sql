-- Search over the index (services/search/index_pg.py, paths.py, keyword_terms.py): the
-- statements that run as they are written here. The two candidate statements,
-- search_vector_candidates and search_keyword_candidates, are assembled per model, vector
-- path and kinds of candidates from the fragments in statement_fragments.pgsql
-- (statements.py).

-- name: export_snapshot
-- Hybrid search's snapshot, for the connection that reads its other list at the same time
-- (index_pg: SET TRANSACTION SNAPSHOT, first in that connection's REPEATABLE READ
-- transaction). Valid while this transaction lives; taken by this first statement.
SELECT pg_export_snapshot()

-- name: choose_vector_path
-- The vector list's path (statements.VectorPath) and what decides it: `broad`, whether the
-- principals $2 may read more than $5 chunks of tenant $1's current search versions of model
-- $3 (within the document ids filter $4); whether the tenant has a valid graph of its own
-- ($6), which the ANN path then walks with its own ef_search; and `path`, ANN when broad AND
-- there is a graph to walk, else EXACT. paths.py keeps the answer a short while and sets the
-- transaction up for the path (statements.vector_path_settings_sql).
-- A graph to walk: the tenant's own ($6), or the model's partitioned index ($7), valid once
-- every partition's part is attached -- the indexers build it only with
-- KB_INDEXER_PARTITION_GRAPHS. Without either, ANN's settings (sorting off, no materialize)
-- would make a plan that reads the tenant's partition in full and slowly: EXACT reads the
-- readable documents' chunks instead. Both are looked up by name (an index probe of
-- pg_class each). Hybrid's keyword list follows `broad` alone, graph or not
-- (statement_fragments.pgsql: searchable_chunks): its plan depends on how much the
-- principals read, not on the vector index.
-- The count reads the readable documents' chunk counts (written by each switch) only until
-- their running sum passes $5 -- the window emits row by row, and EXISTS stops at the first
-- row over -- so a principal who may read the whole tenant costs $5 / (chunks per document)
-- pointer rows, not the tenant's (an index-only scan of migrations/0016's index).
SELECT CASE WHEN b.broad AND (g.tenant_graph OR g.partition_graph) THEN 'ann'
            ELSE 'exact' END AS path,
       b.broad,
       g.tenant_graph
  FROM (
        SELECT EXISTS (
                 SELECT 1
                   FROM (SELECT sum(coalesce(s.chunk_count, 0))
                                  OVER (ROWS UNBOUNDED PRECEDING) AS running
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
                  WHERE r.running > $5) AS broad) b
 CROSS JOIN (
        -- The tenant's own graph (services/indexer/sink/tenant_graphs.py) and the model's
        -- partitioned index (services/index/ann.py), each when valid: the planner walks the
        -- tenant's rather than its partition's (the smaller index).
        SELECT coalesce(bool_or(c.relname = $6::text), false) AS tenant_graph,
               coalesce(bool_or(c.relname = $7::text), false) AS partition_graph
          FROM pg_class c
          JOIN pg_index i ON i.indexrelid = c.oid
         WHERE c.relname IN ($6::text, $7::text)
           AND c.relnamespace = (
                 -- include: knowledge_chunk_schema
               )
           AND i.indisvalid) g

-- name: undo_vector_path
-- Back to the session's planner settings $1 (statements.PLANNER_SETTINGS), after the vector
-- path's: for the statements that follow the vector list in the same transaction (hybrid's
-- keyword list when no second connection was free; keyword_terms wants its generic plan).
SELECT set_config(name, reset_val, true)
  FROM pg_settings
 WHERE name = ANY ($1::text[])

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
-- joins off, as the vector list's paths have them (statements.vector_path_settings_sql);
-- and, as there too, no parallel plans, which the planner would cost out for every scan of
-- a list that never takes one.
-- The planner takes the readable documents for a hundredth of what they are (it takes
-- document ids to be independent of the tenant); free to hash them, it joined the tenant's
-- pointers with them and tested every readable chunk's tsvector, where a nested loop starts
-- from the full-text index's matches and probes each one's pointer and ACL: the hash join
-- was the slower plan for the typical user once migrations/0016's covering index made the
-- pointers cheap to read in full, and the same either way for the whole tenant or a
-- narrow principal.
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

-- name: tenant_common_lexemes
-- The commonest lexemes of tenant $1's chunks of model $4, counted in a sample of them: at
-- most $3 chunks, taken in document-id order from $2 on and, past the last document, from
-- the first (the publisher's document ids are random UUIDs, so a run of them is a random
-- sample of documents; the start is fixed per tenant, so that the sample, and the terms a
-- query gets, stay the same while the tenant's chunks do). Each row: how many chunks the
-- sample holds, how many the tenant's search pointers serve (their chunk counts, summed
-- by an index-only scan of document_search_version_current), and one lexeme with the
-- number of sampled chunks holding it, the $5 commonest, seen at least twice (once says
-- little of a word's commonness); keyword_terms.WordSample scales the counts up.
-- The tenant's own chunks, not its partition's statistics: tenants sharing a partition do
-- not shape each other's candidates, and no ANALYZE is needed.
-- Both branches of the sample are range scans of the primary key (the outer LIMIT stops
-- the second once the first ran short). ts_stat counts the lexemes in C, several times
-- faster than unnesting them in SQL; it takes its sample's statement as text, the values
-- quoted by format's %L.
WITH sample AS (
    SELECT ts_stat.word, ts_stat.ndoc, ts_stat.nentry
      FROM ts_stat(format(
             'SELECT s.search_document
                FROM ((SELECT c.search_document FROM knowledge_chunk c
                        WHERE c.tenant_id = %1$L AND c.document_id >= %2$L::uuid
                          AND c.embedding_model = %4$L
                        ORDER BY c.document_id LIMIT %3$s)
                      UNION ALL
                      (SELECT c.search_document FROM knowledge_chunk c
                        WHERE c.tenant_id = %1$L AND c.document_id < %2$L::uuid
                          AND c.embedding_model = %4$L
                        ORDER BY c.document_id LIMIT %3$s)
                       LIMIT %3$s) s',
             $1::text, $2::text, $3::integer, $4::text))
), sampled AS (
    SELECT count(*) AS chunks
      FROM ((SELECT 1 FROM knowledge_chunk c
              WHERE c.tenant_id = $1 AND c.document_id >= $2::uuid AND c.embedding_model = $4
              ORDER BY c.document_id LIMIT $3)
            UNION ALL
            (SELECT 1 FROM knowledge_chunk c
              WHERE c.tenant_id = $1 AND c.document_id < $2::uuid AND c.embedding_model = $4
              ORDER BY c.document_id LIMIT $3)
             LIMIT $3) s
)
SELECT h.chunks AS sampled,
       (SELECT coalesce(sum(p.chunk_count), 0)
          FROM document_search_version p
         WHERE p.tenant_id = $1 AND p.embedding_model = $4) AS served_chunks,
       w.word AS lexeme, w.ndoc AS chunks
  FROM sampled h
  LEFT JOIN LATERAL (
        SELECT t.word, t.ndoc
          FROM sample t
         WHERE t.ndoc >= 2
         ORDER BY t.ndoc DESC, t.word
         LIMIT $5) w ON true

-- name: knowledge_chunk_schema
-- The schema of knowledge_chunk, its partitions and their indexes, in which
-- choose_vector_path looks one of them up by name (an index probe of pg_class).
SELECT k.relnamespace
  FROM pg_class k
 WHERE k.oid = 'knowledge_chunk'::regclass

-- name: serving_generation
-- The search generation serving tenant $1 (services/search/serving.py), read before each
-- search to choose the query's embedder and the statements of its model: the tenant's
-- serving row in tenant_search_generation, else the default generation (a tenant never
-- pinned to one is served by it); no row in a database without either (no indexer has
-- registered a generation yet: search reads the configured model, as before generations).
-- A probe of tenant_search_generation_serving, then (only for a tenant without a serving row:
-- coalesce leaves the second subquery unrun) the default from search_generation, a table of
-- a few rows, then its primary key. No lock and not in the search's own transaction: a switch
-- (`kb index generations switch`) rewrites the tenant's search pointers and flips its
-- serving row in one transaction, so a search that read the old generation here and took
-- its snapshot after that commit finds no pointer of the old model and answers nothing;
-- serving.py then reads this again and, when it changed, searches once more with the new one.
SELECT g.generation_id, g.provider_profile, g.embedding_model, g.dimension,
       g.chunk_max_tokens, g.chunk_overlap_tokens, g.chunking_settings, g.is_default, g.state
  FROM search_generation g
 WHERE g.generation_id = coalesce(
         (SELECT t.generation_id
            FROM tenant_search_generation t
           WHERE t.tenant_id = $1
             AND t.serving),
         (SELECT d.generation_id
            FROM search_generation d
           WHERE d.is_default))
