-- Garbage collection of superseded chunks, outside the switch (services/indexer/gc/,
-- docs/architecture.md#garbage-collection).
--
-- Before: every completion deleted its document's older versions of the served generation
-- in the fenced transaction that switched the pointer, so a switch of a large document was
-- as long as the delete of its previous version, and a generation built beside the served
-- one was never cleaned. Now a completion only marks its document here (one row, ON CONFLICT
-- DO NOTHING: a document republished a hundred times before the collector runs is one row),
-- and the collector deletes, in bounded batches and transactions of its own, every version
-- older than the newest KB_INDEX_KEEP_PREVIOUS versions below the one each generation
-- serves.
--
-- A row is taken FOR UPDATE SKIP LOCKED by one collector at a time and deleted in the
-- transaction that deleted the document's last batch: a crash leaves it for the next
-- collector, and two collectors never work on one document.
CREATE TABLE index_gc_due (
    tenant_id    text        NOT NULL,
    document_id  uuid        NOT NULL,
    marked_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, document_id)
);

-- The collector takes the oldest marks first.
CREATE INDEX index_gc_due_marked_at ON index_gc_due (marked_at);
