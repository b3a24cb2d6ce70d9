-- The erase's batches (services/runtime/erasure/erase_pg.py, docs/architecture.md#document-
-- lifecycle), run by the publisher's erase and again by `kb index check --repair` to finish
-- one or to remove what a deleted document may not keep. Each statement is one short
-- transaction of its own, run as the tables' owner,
-- and removes at most $3 rows: a large document is erased in many small transactions that
-- hold no lock a publish or a search waits for (row locks on the erased document's own
-- rows only; searches read their snapshot). Every statement is idempotent: a re-run after a
-- crash does again only what is left, and two erases of one document running at once only
-- wait for each other's row locks (a row the other removed is skipped, a payload the other
-- rewrote is rewritten to the same bytes). Each batch returns ``removed``, the rows it
-- changed, and ``seen``, the rows its snapshot held for it: a batch whose rows another
-- session deleted while it waited on their locks removes none though more are left, so a
-- step ends only with a batch that saw nothing. The fence: every removal names a deleted
-- document (document.deleted_at, final by migration 0030's trigger) in its own statement,
-- so no batch, whoever runs it, ever touches a live document's rows.

-- name: deleted_document
-- $1 tenant, $2 document: the fence every removal below reads in its own statement (the
-- document is deleted, and a delete is final).
SELECT 1
  FROM document
 WHERE tenant_id = $1
   AND document_id = $2
   AND deleted_at IS NOT NULL

-- name: erase_staged_slices
-- $1 tenant, $2 document, $3 batch rows. Slices staged by any task of the document
-- (knowledge_chunk_stream, no tenant column: reached through the document's tasks).
WITH doomed AS (
    SELECT s.task_id, s.lease_attempt, s.ordinal
      FROM knowledge_chunk_stream s
      JOIN index_task t ON t.task_id = s.task_id
     WHERE t.tenant_id = $1
       AND t.document_id = $2
       AND EXISTS (
           -- include: deleted_document
       )
     LIMIT $3
), gone AS (
    DELETE FROM knowledge_chunk_stream s
     USING doomed d
     WHERE (s.task_id, s.lease_attempt, s.ordinal) = (d.task_id, d.lease_attempt, d.ordinal)
    RETURNING 1
)
SELECT (SELECT count(*) FROM gone) AS removed, (SELECT count(*) FROM doomed) AS seen

-- name: erase_chunks
-- $1 tenant, $2 document, $3 batch rows. Chunks and embeddings of every version in every
-- generation (they all live in knowledge_chunk, partitioned by tenant). The embedding reuse
-- cache is these rows themselves (sink.sql: known_embeddings reads any chunk of the tenant
-- with the digest): an entry only this document used goes with its chunk; another
-- document's chunk with the same digest is that document's, and stays.
-- A batch is a range of the primary key: the document's first $3 keys, up to the $3-th
-- (all of them when it has fewer). One index range scan, whatever the statistics say: a
-- join of the batch's keys back to the table was planned as a nested loop over every chunk
-- of a just-indexed document (its partition's statistics still saying "1 row"), quadratic
-- in its size (a 10,000-chunk document took minutes). ``seen``: whether the snapshot held
-- any chunk of the deleted document (0 or 1).
WITH gone AS (
    DELETE FROM knowledge_chunk k
     WHERE k.tenant_id = $1
       AND k.document_id = $2
       AND EXISTS (
           -- include: deleted_document
       )
       AND (NOT EXISTS (SELECT 1
                          FROM knowledge_chunk l
                         WHERE l.tenant_id = $1
                           AND l.document_id = $2
                        OFFSET $3 - 1)
            OR (k.version_number, k.embedding_model, k.chunk_id)
               <= (SELECT l.version_number, l.embedding_model, l.chunk_id
                     FROM knowledge_chunk l
                    WHERE l.tenant_id = $1
                      AND l.document_id = $2
                    ORDER BY l.version_number, l.embedding_model, l.chunk_id
                   OFFSET $3 - 1
                    LIMIT 1))
    RETURNING 1
)
SELECT (SELECT count(*) FROM gone) AS removed,
       (SELECT count(*)
          FROM (SELECT 1
                  FROM knowledge_chunk l
                 WHERE l.tenant_id = $1
                   AND l.document_id = $2
                   AND EXISTS (
                       -- include: deleted_document
                   )
                 LIMIT 1) s) AS seen

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
       AND EXISTS (
           -- include: deleted_document
       )
     ORDER BY version_number
     LIMIT $3
), gone AS (
    UPDATE document_version v
       SET content = ''::bytea
      FROM doomed d
     WHERE v.tenant_id = $1
       AND v.document_id = $2
       AND v.version_number = d.version_number
    RETURNING 1
)
SELECT (SELECT count(*) FROM gone) AS removed, (SELECT count(*) FROM doomed) AS seen

-- name: erase_version_acl
-- $1 tenant, $2 document, $3 batch rows. The versions' ACLs (principals are people).
WITH doomed AS (
    SELECT version_number, principal, permission
      FROM document_version_acl
     WHERE tenant_id = $1
       AND document_id = $2
       AND EXISTS (
           -- include: deleted_document
       )
     LIMIT $3
), gone AS (
    DELETE FROM document_version_acl a
     USING doomed d
     WHERE a.tenant_id = $1
       AND a.document_id = $2
       AND (a.version_number, a.principal, a.permission)
           = (d.version_number, d.principal, d.permission)
    RETURNING 1
)
SELECT (SELECT count(*) FROM gone) AS removed, (SELECT count(*) FROM doomed) AS seen

-- name: erase_served_acl
-- $1 tenant, $2 document, $3 batch rows. The served ACL: the delete drops it in its own
-- transaction; a row found here was put back by hand or by a restore.
WITH doomed AS (
    SELECT principal, permission
      FROM document_acl
     WHERE (tenant_id, document_id) = ($1, $2)
       AND EXISTS (
           -- include: deleted_document
       )
     LIMIT $3
), gone AS (
    -- The served ACL's key is the document's and (principal, permission).
    DELETE FROM document_acl a
     WHERE (a.tenant_id, a.document_id) = ($1, $2)
       AND (a.principal, a.permission) IN (SELECT principal, permission FROM doomed)
    RETURNING 1
)
SELECT (SELECT count(*) FROM gone) AS removed, (SELECT count(*) FROM doomed) AS seen

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
       AND EXISTS (
           -- include: deleted_document
       )
     LIMIT $3
), gone AS (
    UPDATE index_task t
       SET error_message = NULL
      FROM doomed d
     WHERE t.task_id = d.task_id
    RETURNING 1
)
SELECT (SELECT count(*) FROM gone) AS removed, (SELECT count(*) FROM doomed) AS seen

-- name: erase_requeue_messages
-- $1 tenant, $2 document, $3 batch rows. The requeue audit's copies of those texts.
WITH doomed AS (
    SELECT q.requeue_id
      FROM index_task_requeue q
      JOIN index_task t ON t.task_id = q.task_id
     WHERE q.previous_error_message IS NOT NULL
       AND (t.tenant_id, t.document_id) = ($1, $2)
       AND EXISTS (
           -- include: deleted_document
       )
     LIMIT $3
), gone AS (
    UPDATE index_task_requeue r SET previous_error_message = NULL
     WHERE r.requeue_id IN (SELECT requeue_id FROM doomed)
    RETURNING 1
)
SELECT (SELECT count(*) FROM gone) AS removed, (SELECT count(*) FROM doomed) AS seen

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

-- name: tombstone_deleted_pointer
-- $1 tenant, $2 document, $3 now. A deleted document's pointer that is not its tombstone (a
-- restore, a hand-edited row), or that is missing, becomes the tombstone the delete wrote
-- (services/publisher/queries.sql: tombstone_search_pointer): no strategy, no chunks, the
-- document's deletion time, at its latest version or the one the pointer names if higher
-- (forward only, migrations 0006 and 0021). From its commit on, search serves nothing of the
-- document and a late completion finds a tombstone to refuse on. The fence is the
-- document's deleted_at, read in this statement.
INSERT INTO document_search_version AS s (tenant_id, document_id, version_number,
                                          embedding_model, chunking_strategy, chunk_count,
                                          task_id, switched_at, deleted_at)
SELECT d.tenant_id, d.document_id, v.latest, '', NULL, 0, NULL,
       coalesce($3::timestamptz, now()), d.deleted_at
  FROM document d
  JOIN LATERAL (SELECT max(version_number) AS latest
                  FROM document_version dv
                 WHERE dv.tenant_id = d.tenant_id
                   AND dv.document_id = d.document_id) v ON v.latest IS NOT NULL
 WHERE d.tenant_id = $1
   AND d.document_id = $2
   AND d.deleted_at IS NOT NULL
ON CONFLICT (tenant_id, document_id) DO UPDATE
   SET (version_number, chunking_strategy, chunk_count, task_id, switched_at, deleted_at)
       = (greatest(s.version_number, EXCLUDED.version_number), NULL, 0, NULL,
          EXCLUDED.switched_at, EXCLUDED.deleted_at)
 WHERE s.deleted_at IS NULL

-- name: deleted_document_leftovers
-- $1 tenant (NULL: every tenant), $2 the title an erased document keeps. One row per deleted
-- document, counting what it still holds that it may not: for every deleted document its
-- chunks (every version, every generation), staged slices, served ACL rows and whether its
-- pointer is its tombstone; for one whose erase was asked for, also what the erase removes
-- (versions' bytes, versions' ACL rows, error texts of its tasks and requeue rows, its title,
-- erased_at). Counts and ids only: no content is read (octet_length reads a stored value's
-- header, not its bytes). Each count is a probe of a primary key prefix.
SELECT d.tenant_id, d.document_id, d.deleted_at,
       e.requested_at AS erase_requested_at, e.erased_at,
       s.document_id IS NOT NULL AND s.deleted_at IS NOT NULL AS tombstoned,
       s.version_number AS pointer_version,
       (SELECT count(*) FROM knowledge_chunk k
         WHERE k.tenant_id = d.tenant_id AND k.document_id = d.document_id) AS chunks,
       (SELECT count(*) FROM knowledge_chunk_stream c
          JOIN index_task t ON t.task_id = c.task_id
         WHERE t.tenant_id = d.tenant_id AND t.document_id = d.document_id) AS staged_slices,
       (SELECT count(*) FROM document_acl a
         WHERE a.tenant_id = d.tenant_id AND a.document_id = d.document_id) AS served_acl,
       (SELECT count(*) FROM document_version v
         WHERE e.document_id IS NOT NULL
           AND v.tenant_id = d.tenant_id AND v.document_id = d.document_id
           AND octet_length(v.content) > 0) AS version_bytes,
       (SELECT count(*) FROM document_version_acl va
         WHERE e.document_id IS NOT NULL
           AND va.tenant_id = d.tenant_id AND va.document_id = d.document_id) AS version_acl,
       (SELECT count(*) FROM index_task t
         WHERE e.document_id IS NOT NULL
           AND t.tenant_id = d.tenant_id AND t.document_id = d.document_id
           AND t.error_message IS NOT NULL) AS task_messages,
       (SELECT count(*) FROM index_task_requeue r
          JOIN index_task t ON t.task_id = r.task_id
         WHERE e.document_id IS NOT NULL
           AND t.tenant_id = d.tenant_id AND t.document_id = d.document_id
           AND r.previous_error_message IS NOT NULL) AS requeue_messages,
       e.document_id IS NOT NULL AND d.title <> $2 AS title_kept
  FROM document d
  LEFT JOIN document_erasure e
         ON e.tenant_id = d.tenant_id AND e.document_id = d.document_id
  LEFT JOIN document_search_version s
         ON s.tenant_id = d.tenant_id AND s.document_id = d.document_id
 WHERE d.deleted_at IS NOT NULL
   AND ($1::text IS NULL OR d.tenant_id = $1)
 ORDER BY d.tenant_id, d.document_id
