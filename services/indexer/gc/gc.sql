-- The collector of superseded chunks (services/indexer/gc/collector.py, migration 0023).

-- name: mark_document
-- $1 tenants, $2 documents, one (tenant, document) pair per element (several for a group
-- written together, services/indexer/sink/together.py: inserted -- and so locked -- in
-- (tenant, document) order, the order every group takes them in), $3 now. Run by every
-- completion, in its fenced transaction, before it writes any chunk row: the document may
-- hold chunks no generation will serve again. One row per document however often it is
-- marked before the collector comes; an existing mark keeps its place in line. A completion
-- sends it as part of its pointer's lock (sink.sql: lock_search_pointer includes it). DO UPDATE, not DO NOTHING: the row is locked until this
-- completion commits, so a collector (take_due_documents, SKIP LOCKED) cannot take the mark
-- meanwhile, find nothing yet to delete and forget the document -- the mark would be gone
-- before the version it was for committed. A collector already holding the mark finishes
-- its round first (the completion waits for it here, holding no chunk row yet: the
-- two lock in the same order, the mark then chunks).
INSERT INTO index_gc_due (tenant_id, document_id, marked_at)
SELECT k.tenant_id, k.document_id, coalesce($3::timestamptz, now())
  FROM unnest($1::text[], $2::uuid[]) AS k (tenant_id, document_id)
 ORDER BY k.tenant_id, k.document_id
ON CONFLICT (tenant_id, document_id) DO UPDATE SET marked_at = index_gc_due.marked_at

-- name: take_due_documents
-- $1 most documents. The oldest marked documents no other collector holds. Their rows stay
-- locked until this transaction ends: the collector deletes them (the documents are clean)
-- or leaves them for the next round (a batch was full); a crash or a rollback leaves them
-- for whoever comes next. SKIP LOCKED: collectors in several indexer processes never wait
-- for each other, never work on the same document, and never wait for a completion that
-- holds a mark (the completion may wait for a collector, never the other way round). In
-- (tenant, document) order, as delete_superseded_chunks takes them a tenant at a time.
SELECT tenant_id, document_id
  FROM (SELECT tenant_id, document_id
          FROM index_gc_due
         ORDER BY marked_at
         LIMIT $1
           FOR UPDATE SKIP LOCKED) due
 ORDER BY tenant_id, document_id

-- name: delete_superseded_chunks
-- $1 tenant, $2 documents of that tenant (taken by take_due_documents), $3 versions kept
-- below the served one (KB_INDEX_KEEP_PREVIOUS), $4 most rows deleted by this statement
-- (for all the documents together), $5 the code mark of strategy ids (':code=').
-- A chunk family is a document's (model, chunk settings): the chunks one generation writes
-- of it, whichever code chunked them. Per family, the served version is the newest that
-- any generation has complete (document_generation_version) or that the search pointer
-- names; every version of the family below it is deleted except the newest $3 of them.
-- Families that nothing serves (a generation being retired: `kb index generations retire`
-- deletes those) and versions above the served one are left alone. ``removed``: the
-- document of every row deleted; ``seen``: the rows its snapshot held for the batch. Rows
-- that version retention, an erase or a retire deleted while the batch waited on their locks
-- are skipped, so a batch may remove fewer than it saw with more rows left past it: only
-- ``seen`` below the batch size says the documents are clean.
-- Why it is safe without the pointer's lock: a served version only moves forward (the
-- pointer's and document_generation_version's forward-only triggers), so a version below
-- an old reading of it is below every later one too, and is never served again. A search
-- in flight keeps reading the rows it sees in its snapshot (MVCC). Embedding reuse reads any
-- version: content only an old version held is embedded again if it comes back.
-- Cost: the documents' rows, through the primary key prefix (tenant_id, document_id) of the
-- tenant's partition, twice (the families' versions, then the victims).
WITH served AS (
    SELECT d.document_id, g.embedding_model, g.chunking_settings AS settings,
           d.version_number
      FROM document_generation_version d
      JOIN search_generation g ON g.generation_id = d.generation_id
     WHERE d.tenant_id = $1
       AND d.document_id = ANY ($2::uuid[])
       AND g.chunking_settings IS NOT NULL
    UNION ALL
    SELECT s.document_id, s.embedding_model, split_part(s.chunking_strategy, $5::text, 1),
           s.version_number
      FROM document_search_version s
     WHERE s.tenant_id = $1
       AND s.document_id = ANY ($2::uuid[])
       AND s.chunking_strategy IS NOT NULL
),
anchor AS (
    SELECT document_id, embedding_model, settings, max(version_number) AS served
      FROM served
     GROUP BY document_id, embedding_model, settings
),
family_version AS (
    SELECT DISTINCT c.document_id, c.embedding_model,
           split_part(c.chunking_strategy, $5::text, 1) AS settings, c.version_number
      FROM knowledge_chunk c
     WHERE c.tenant_id = $1
       AND c.document_id = ANY ($2::uuid[])
),
doomed AS (
    SELECT v.document_id, v.embedding_model, v.settings, v.version_number
      FROM (SELECT f.*, row_number() OVER (PARTITION BY f.document_id, f.embedding_model,
                                                        f.settings
                                           ORDER BY f.version_number DESC) AS below
              FROM family_version f
              JOIN anchor a ON a.document_id = f.document_id
                           AND a.embedding_model = f.embedding_model
                           AND a.settings = f.settings
             WHERE f.version_number < a.served) v
     WHERE v.below > $3::integer
),
victim AS (
    SELECT c.document_id, c.version_number, c.embedding_model, c.chunk_id
      FROM knowledge_chunk c
      JOIN doomed d ON d.document_id = c.document_id
                   AND d.embedding_model = c.embedding_model
                   AND d.version_number = c.version_number
                   AND d.settings = split_part(c.chunking_strategy, $5::text, 1)
     WHERE c.tenant_id = $1
       AND c.document_id = ANY ($2::uuid[])
     LIMIT $4::integer
), gone AS (
    DELETE FROM knowledge_chunk c
     USING victim v
     WHERE c.tenant_id = $1
       AND c.document_id = v.document_id
       AND c.version_number = v.version_number
       AND c.embedding_model = v.embedding_model
       AND c.chunk_id = v.chunk_id
    RETURNING c.document_id
)
SELECT coalesce((SELECT array_agg(document_id) FROM gone), '{}') AS removed,
       (SELECT count(*) FROM victim) AS seen

-- name: forget_documents
-- $1 tenants, $2 documents: their marks, once a round's batch of them saw fewer rows than
-- a batch holds (they are clean).
DELETE FROM index_gc_due g
 USING unnest($1::text[], $2::uuid[]) AS f (tenant_id, document_id)
 WHERE g.tenant_id = f.tenant_id
   AND g.document_id = f.document_id

-- name: count_due
SELECT count(*) AS due, min(marked_at) AS oldest FROM index_gc_due
