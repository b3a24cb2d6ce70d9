-- Deleting a document (issue 43, docs/architecture.md#document-lifecycle): one transaction
-- of the publisher marks the document deleted, moves its search pointer forward to a
-- tombstone, drops its served ACL, ends its unfinished index tasks and adds a
-- DocumentDeleted event. This file gives the tombstone its columns and the rules that make
-- it final: nothing (a late completion, a retry, a repair, a generation switch, a script)
-- can serve the document again.
--
-- Both ALTERs add a nullable column without a default (a catalog change, no rewrite) and a
-- NOT VALID check (enforced on every row written from now on, no scan): the ACCESS
-- EXCLUSIVE locks are held for a moment only. Queued behind a long writer they would hold
-- publishes and switches up behind them: give up after 10 s instead (run `kb migrate` again).
SET LOCAL lock_timeout = '10s';

-- 1. The document: when it was deleted (NULL: it is not). Once set it never changes: a
-- delete is not undone by a publish (the publisher refuses it: DOCUMENT_DELETED), and the
-- trigger below refuses any other writer that would clear it.
ALTER TABLE document ADD COLUMN deleted_at timestamptz;

CREATE FUNCTION document_deleted_is_final() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'document %/% was deleted at %; a delete is final',
        OLD.tenant_id, OLD.document_id, OLD.deleted_at
        USING ERRCODE = 'check_violation',
              CONSTRAINT = 'document_deleted_is_final';
END
$$;

CREATE TRIGGER document_deleted_is_final
    BEFORE UPDATE ON document
    FOR EACH ROW
    WHEN (OLD.deleted_at IS NOT NULL AND NEW.deleted_at IS DISTINCT FROM OLD.deleted_at)
    EXECUTE FUNCTION document_deleted_is_final();

-- 2. The search pointer's tombstone: deleted_at set, no chunking strategy, no chunks. Search
-- joins the pointer's model and strategy to the chunks' (current_search_version): a NULL
-- strategy matches no chunk, so a tombstone serves nothing, in every search statement and
-- on every replica that has replayed the delete's commit. Its version is the document's
-- latest at the delete (never below the one it served: forward only, migrations 0006 and
-- 0021), so no version of the document is above the tombstone.
ALTER TABLE document_search_version
    ADD COLUMN deleted_at timestamptz,
    ADD CONSTRAINT document_search_version_tombstone_serves_nothing
        CHECK (deleted_at IS NULL OR (chunking_strategy IS NULL AND chunk_count = 0))
        NOT VALID;

-- A tombstone is final: no UPDATE (the sink's switch, a generation switch's rewrite) and no
-- DELETE (a --force switch dropping pointers, a script) of it. The sink checks the tombstone
-- itself before writing anything (services/indexer/sink/together.py: DOCUMENT_DELETED);
-- this trigger is the wall behind it for every other writer.
CREATE FUNCTION document_search_version_tombstone_is_final() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'document %/% was deleted: its search pointer is a tombstone (% refused)',
        OLD.tenant_id, OLD.document_id, TG_OP
        USING ERRCODE = 'check_violation',
              CONSTRAINT = 'document_search_version_tombstone';
END
$$;

CREATE TRIGGER document_search_version_tombstone_is_final
    BEFORE UPDATE OR DELETE ON document_search_version
    FOR EACH ROW
    WHEN (OLD.deleted_at IS NOT NULL)
    EXECUTE FUNCTION document_search_version_tombstone_is_final();

-- 3. A running task's staged slices (knowledge_chunk_stream, migration 0013) go with it: a
-- task that ends DEAD takes them along (queue/queries.sql: fail_task), and no later attempt
-- of a task the delete ended will run to delete them. The table has no tenant column, so no
-- row security: rather than open it to the API's role, the delete calls this function,
-- which runs as the table's owner and deletes only the slices of the given tasks of the
-- given tenant that a delete ended (DEAD, DOCUMENT_DELETED), and, behind the wall, only for
-- the wall's own tenant. A slice being staged holds its task row (sink.sql:
-- lock_stream_lease, FOR SHARE), which the delete's FOR UPDATE waits for: every slice
-- committed before the delete ended the task is seen here, and none can come after.
CREATE FUNCTION discard_deleted_tasks_staging(tenant text, task_ids uuid[]) RETURNS bigint
LANGUAGE sql SECURITY DEFINER SET search_path FROM CURRENT AS $$
    WITH gone AS (
        DELETE FROM knowledge_chunk_stream s
         USING index_task t
         WHERE t.task_id = ANY (task_ids)
           AND t.tenant_id = tenant
           AND coalesce(nullif(current_setting('kb.tenant_id', true), ''), tenant) = tenant
           AND t.status = 'DEAD'
           AND t.error_code = 'DOCUMENT_DELETED'
           AND s.task_id = t.task_id
        RETURNING 1
    )
    SELECT count(*) FROM gone
$$;
REVOKE ALL ON FUNCTION discard_deleted_tasks_staging(text, uuid[]) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION discard_deleted_tasks_staging(text, uuid[]) TO kb_tenant_api;

-- 4. What the delete's transaction writes as the API's role (migration 0029's wall): the
-- tombstone of a document never served (an INSERT, whose trigger raises the high-water mark,
-- migration 0021), and the end of the document's unfinished tasks (only the columns a
-- task's end sets).
GRANT INSERT ON document_search_version TO kb_tenant_api;
GRANT SELECT, INSERT, UPDATE ON document_search_version_high_water TO kb_tenant_api;
GRANT UPDATE (status, error_code, error_message, lease_owner, lease_until, finished_at,
              updated_at)
   ON index_task TO kb_tenant_api;
