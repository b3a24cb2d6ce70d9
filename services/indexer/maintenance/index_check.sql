-- `kb index check` (services/indexer/maintenance/index_check_pg.py).

-- name: document_index_states
-- $1 tenant (NULL: every tenant), $2 task type. One statement, one snapshot: the pointer, the
-- chunks it names and the tasks are read as of the same instant, so a switch committing
-- meanwhile is seen whole or not at all (never "pointer moved, chunks not yet there").
-- The chunks present are those search serves (current_version_chunks): per served document,
-- one probe of the pointer's primary key and one primary-key range scan of its chunks.
-- current_strategy: the strategy the indexers chunk the pointer's model and chunk settings
-- with now -- that of the generation of those registered last (each indexer registers its
-- own at start, and each search generation it builds) -- and served_code / current_code the
-- versions of the code each was chunked with, when recorded (migration 0021). Other chunk
-- settings of the same model are another search generation (migration 0022), not newer
-- code: they are not compared. index_generation holds a few rows: read once, joined by hash.
WITH current_generation AS (
    SELECT DISTINCT ON (embedding_model, split_part(chunking_strategy, ':code=', 1))
           embedding_model, split_part(chunking_strategy, ':code=', 1) AS settings,
           chunking_strategy, chunking_code
      FROM index_generation
     ORDER BY embedding_model, split_part(chunking_strategy, ':code=', 1),
              registered_at DESC, created_at DESC, chunking_strategy
)
SELECT d.tenant_id, t.tier, d.document_id, d.published_version,
       s.version_number AS served_version, s.chunk_count AS recorded_chunks,
       present.chunks AS present_chunks,
       pt.task_id AS published_task_id, pt.status AS published_task_status,
       st.task_id AS served_task_id, st.status AS served_task_status,
       s.chunking_strategy AS served_strategy, cg.chunking_strategy AS current_strategy,
       sg.chunking_code::text AS served_code, cg.chunking_code::text AS current_code
  FROM document d
  JOIN tenant t ON t.tenant_id = d.tenant_id
  LEFT JOIN document_search_version s
         ON s.tenant_id = d.tenant_id AND s.document_id = d.document_id
  LEFT JOIN index_task pt
         ON pt.tenant_id = d.tenant_id AND pt.document_id = d.document_id
        AND pt.version_number = d.published_version AND pt.task_type = $2
        AND pt.generation_id IS NULL
  LEFT JOIN index_task st
         ON st.tenant_id = d.tenant_id AND st.document_id = d.document_id
        AND st.version_number = s.version_number AND st.task_type = $2
        AND st.generation_id IS NULL
  LEFT JOIN index_generation sg
         ON sg.embedding_model = s.embedding_model AND sg.chunking_strategy = s.chunking_strategy
  LEFT JOIN current_generation cg
         ON cg.embedding_model = s.embedding_model
        AND cg.settings = split_part(s.chunking_strategy, ':code=', 1)
  LEFT JOIN LATERAL (
        SELECT count(*)::integer AS chunks
          FROM (
                -- include: current_version_chunks from services/runtime/indexing/search_version.sql
               ) AS c
         WHERE c.tenant_id = s.tenant_id
           AND c.document_id = s.document_id
       ) present ON s.document_id IS NOT NULL
 WHERE ($1::text IS NULL OR d.tenant_id = $1)
   AND (d.published_version IS NOT NULL OR s.document_id IS NOT NULL)
   -- A deleted document is never indexed again: what it still holds is read by
   -- services/runtime/erasure/erase.sql (deleted_document_leftovers), not here.
   AND d.deleted_at IS NULL
 ORDER BY d.tenant_id, d.document_id

-- name: task_statuses
-- $1 task ids: the status of each that exists (`kb index check --repair` waits for the tasks
-- of its repairs to finish).
SELECT task_id, status
  FROM index_task
 WHERE task_id = ANY ($1::uuid[])

-- name: tenant_exists
SELECT EXISTS (SELECT 1 FROM tenant WHERE tenant_id = $1)
