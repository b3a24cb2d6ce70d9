-- The erase's batches (services/publisher/erase_pg.py, docs/architecture.md#document-
-- lifecycle). Each statement is one short transaction of its own, run as the tables' owner,
-- and removes at most $3 rows: a large document is erased in many small transactions that
-- hold no lock a publish or a search waits for (row locks on the erased document's own
-- rows only; searches read their snapshot). Every statement is idempotent: a re-run after a
-- crash does again only what is left, and two erases of one document running at once only
-- wait for each other's row locks (a row the other removed is skipped, a payload the other
-- rewrote is rewritten to the same bytes).

-- name: erase_staged_slices
-- $1 tenant, $2 document, $3 batch rows. Slices staged by any task of the document
-- (knowledge_chunk_stream, no tenant column: reached through the document's tasks).
WITH doomed AS (
    SELECT s.task_id, s.lease_attempt, s.ordinal
      FROM knowledge_chunk_stream s
      JOIN index_task t ON t.task_id = s.task_id
     WHERE t.tenant_id = $1
       AND t.document_id = $2
     LIMIT $3
)
DELETE FROM knowledge_chunk_stream s
 USING doomed d
 WHERE (s.task_id, s.lease_attempt, s.ordinal) = (d.task_id, d.lease_attempt, d.ordinal)

-- name: erase_chunks
-- $1 tenant, $2 document, $3 batch rows. Chunks and embeddings of every version in every
-- generation (they all live in knowledge_chunk, partitioned by tenant). The embedding reuse
-- cache is these rows themselves (sink.sql: known_embeddings reads any chunk of the tenant
-- with the digest): an entry only this document used goes with its chunk; another
-- document's chunk with the same digest is that document's, and stays.
WITH doomed AS (
    SELECT version_number, embedding_model, chunking_strategy, chunk_id
      FROM knowledge_chunk
     WHERE tenant_id = $1
       AND document_id = $2
     LIMIT $3
)
DELETE FROM knowledge_chunk k
 USING doomed d
 WHERE k.tenant_id = $1
   AND k.document_id = $2
   AND (k.version_number, k.embedding_model, k.chunking_strategy, k.chunk_id)
       = (d.version_number, d.embedding_model, d.chunking_strategy, d.chunk_id)

-- name: erase_version_content
-- $1 tenant, $2 document, $3 batch rows. Every version's uploaded bytes (the text is
-- extracted from them by the indexer and stored only in the chunks). Migration 0031 lets
-- the content become empty once the document has an erasure row; sha256, size and media
-- type stay.
WITH doomed AS (
    SELECT version_number
      FROM document_version
     WHERE tenant_id = $1
       AND document_id = $2
       AND content <> ''::bytea
     ORDER BY version_number
     LIMIT $3
)
UPDATE document_version v
   SET content = ''::bytea
  FROM doomed d
 WHERE v.tenant_id = $1
   AND v.document_id = $2
   AND v.version_number = d.version_number

-- name: erase_version_acl
-- $1 tenant, $2 document, $3 batch rows. The versions' ACLs (principals are people).
WITH doomed AS (
    SELECT version_number, principal, permission
      FROM document_version_acl
     WHERE tenant_id = $1
       AND document_id = $2
     LIMIT $3
)
DELETE FROM document_version_acl a
 USING doomed d
 WHERE a.tenant_id = $1
   AND a.document_id = $2
   AND (a.version_number, a.principal, a.permission)
       = (d.version_number, d.principal, d.permission)

-- name: erase_task_messages
-- $1 tenant, $2 document, $3 batch rows. Task rows and their codes stay; their error texts
-- (which may quote the content: an extraction error) go. Finished tasks only: the delete
-- ended every unfinished one, and a task is never unfinished again but by a requeue, which
-- the tombstone fences.
WITH doomed AS (
    SELECT task_id
      FROM index_task
     WHERE tenant_id = $1
       AND document_id = $2
       AND error_message IS NOT NULL
     LIMIT $3
)
UPDATE index_task t
   SET error_message = NULL
  FROM doomed d
 WHERE t.task_id = d.task_id

-- name: erase_requeue_messages
-- $1 tenant, $2 document, $3 batch rows. The requeue audit's copies of those texts.
WITH doomed AS (
    SELECT r.requeue_id
      FROM index_task_requeue r
      JOIN index_task t ON t.task_id = r.task_id
     WHERE t.tenant_id = $1
       AND t.document_id = $2
       AND r.previous_error_message IS NOT NULL
     LIMIT $3
)
UPDATE index_task_requeue r
   SET previous_error_message = NULL
  FROM doomed d
 WHERE r.requeue_id = d.requeue_id

-- name: outbox_rows_to_scrub
-- $1 aggregate key, $2 event types, $3 after this position, $4 batch rows. The document's
-- outbox rows whose events may carry content (a title, principals), in position order from
-- a cursor. The relay's windows are sets of transactions (outbox_pg.py), read by txid and
-- position: a row rewritten in place keeps both, so it is delivered in the window it was
-- always in, with the scrubbed payload if not delivered yet. No row is deleted: a delete
-- would not break the relay either (an absent row is simply not read), but rewriting keeps
-- every event a consumer is owed, ids and numbers intact.
SELECT position, payload
  FROM outbox
 WHERE aggregate_key = $1
   AND event_type = ANY ($2::text[])
   AND position > $3
 ORDER BY position
 LIMIT $4

-- name: rewrite_outbox_payload
-- $1 position, $2 the scrubbed payload.
UPDATE outbox
   SET payload = $2
 WHERE position = $1

-- name: finish_erasure
-- $1 tenant, $2 document, $3 the title an erased document keeps, $4 now. The last
-- transaction: the title goes (the column is NOT NULL: a fixed placeholder), the served
-- index's leftovers of the document that name nothing (its gc mark), the producer's key of
-- it (an ingest key may be personal data; an ingest erase forgets it in the transaction
-- that records its command instead, so a redelivery after a crash still finds the
-- document), and the audit row gets erased_at, once.
WITH titled AS (
    UPDATE document
       SET title = $3
     WHERE tenant_id = $1
       AND document_id = $2
    RETURNING 1
), unmarked AS (
    DELETE FROM index_gc_due
     WHERE tenant_id = $1
       AND document_id = $2
    RETURNING 1
), unkeyed AS (
    DELETE FROM ingest_document_key k
     WHERE k.tenant_id = $1
       AND k.document_id = $2
       AND NOT EXISTS (SELECT FROM document_erasure e
                        WHERE e.tenant_id = $1 AND e.document_id = $2
                          AND e.requested_by = 'ingest')
    RETURNING 1
)
UPDATE document_erasure
   SET erased_at = coalesce(erased_at, greatest(coalesce($4::timestamptz, now()), requested_at))
 WHERE tenant_id = $1
   AND document_id = $2
RETURNING erased_at
