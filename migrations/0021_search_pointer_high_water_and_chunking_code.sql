-- Two things `kb index check` and the sink need (docs/architecture.md#invariants, #6, and
-- #index-generations):
--   1. the search pointer only moves forward whatever the statement, DELETE included;
--   2. each generation records the versions of the code that chunked it, and when an indexer
--      last registered it, so the check can say which documents were chunked by older code.
--
-- Pointer switches wait while this runs: the backfill below takes the pointer table's SHARE
-- ROW EXCLUSIVE lock (readers -- searches -- go on, writers wait) and copies one short row
-- per pointer; the new table's key to `document` takes the same lock on `document` for a
-- moment (publishes wait). Queued behind a long writer, either lock would hold everything
-- up behind it: the migration gives up after 10 s instead (and is rolled back whole; run
-- `kb migrate` again).
SET LOCAL lock_timeout = '10s';

-- 1. The highest version each document's pointer ever named -----------------------------
--
-- Migration 0006's trigger refuses an UPDATE that takes a pointer back. A pointer row can
-- also be deleted and inserted again at an older version (by hand, a script, a restore
-- tool, a bug): nothing refused that. Deleting a pointer stays allowed -- the document is
-- then not searchable, which `kb index check` reports and repairs -- but its high-water mark
-- stays here, apart from the pointer so that it outlives the row, and no pointer may name a
-- version below it again.
CREATE TABLE document_search_version_high_water (
    tenant_id       text    NOT NULL,
    document_id     uuid    NOT NULL,
    version_number  integer NOT NULL,
    PRIMARY KEY (tenant_id, document_id),
    -- A document that goes takes its mark with it (nothing deletes documents today); the
    -- pointer's own key to the document has no cascade, so the pointer goes first.
    FOREIGN KEY (tenant_id, document_id) REFERENCES document (tenant_id, document_id)
        ON DELETE CASCADE
);

-- Run after each INSERT of a pointer row, and after each UPDATE that moves it forward or to
-- another document: raises the row's mark to the version the pointer now names, or refuses
-- the statement when the mark is already above it.
--
-- Locking and ordering: the upsert of the mark locks the document's mark row until the
-- transaction ends (ON CONFLICT DO UPDATE locks the existing row even when its WHERE is
-- false, and evaluates that WHERE against the row's latest committed version, not the
-- statement's snapshot). So the pointer writes of one document serialise on the mark, and
-- each is checked against every mark committed before it:
--   * DELETE and then INSERT of an older version, in one transaction or two: the delete
--     leaves the mark, the insert finds it above its version and is refused;
--   * an INSERT racing a forward switch of the same document: whichever takes the mark's row
--     lock second waits for the first to commit, then sees its mark (the pointer's unique
--     key makes two inserts of one document wait for each other as well);
--   * a plain forward switch (the sink's upsert): the pointer row is locked first
--     (lock_search_pointer, or the upsert itself), then the mark: every writer takes the two
--     in that order, so they cannot deadlock each other.
-- Under REPEATABLE READ a mark changed since the snapshot fails the statement with a
-- serialization error instead, which is as safe.
-- An AFTER trigger: for an upsert (INSERT ... ON CONFLICT DO UPDATE) only the row actually
-- inserted or updated fires it, so a switch that moves nothing checks nothing. (A BEFORE
-- INSERT trigger fires for every proposed row, before the conflict is found: it would refuse
-- the upsert of a late task for an older version, which then only takes the conflict path
-- and leaves the pointer alone.)
CREATE FUNCTION document_search_version_high_water() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    highest integer;
BEGIN
    INSERT INTO document_search_version_high_water AS h (tenant_id, document_id, version_number)
    VALUES (NEW.tenant_id, NEW.document_id, NEW.version_number)
    ON CONFLICT (tenant_id, document_id) DO UPDATE
       SET version_number = EXCLUDED.version_number
     WHERE h.version_number < EXCLUDED.version_number
    RETURNING h.version_number INTO highest;
    IF highest IS NULL THEN
        -- Neither inserted nor raised: the mark is at or above NEW's version. The row is
        -- locked by now, so this reads its latest committed value.
        SELECT h.version_number INTO highest
          FROM document_search_version_high_water h
         WHERE h.tenant_id = NEW.tenant_id
           AND h.document_id = NEW.document_id;
    END IF;
    IF highest > NEW.version_number THEN
        RAISE EXCEPTION 'search version of document %/% cannot move back from % to %',
            NEW.tenant_id, NEW.document_id, highest, NEW.version_number
            USING ERRCODE = 'check_violation',
                  CONSTRAINT = 'document_search_version_forward_only',
                  HINT = 'the document served version ' || highest
                         || ' before; a pointer never names an older one again';
    END IF;
    RETURN NULL;
END
$$;

-- The marks of the pointers that exist now, with no switch able to commit in between (the
-- lock is held to the end of this transaction, past the triggers' creation).
LOCK TABLE document_search_version IN SHARE ROW EXCLUSIVE MODE;

INSERT INTO document_search_version_high_water (tenant_id, document_id, version_number)
SELECT tenant_id, document_id, version_number
  FROM document_search_version;

CREATE TRIGGER document_search_version_high_water_insert
    AFTER INSERT ON document_search_version
    FOR EACH ROW
    EXECUTE FUNCTION document_search_version_high_water();

-- Same-version rewrites (a re-run replacing the served chunk set, a generation switch) leave
-- the mark alone and take no lock on it.
CREATE TRIGGER document_search_version_high_water_update
    AFTER UPDATE ON document_search_version
    FOR EACH ROW
    WHEN (NEW.version_number > OLD.version_number
          OR NEW.tenant_id IS DISTINCT FROM OLD.tenant_id
          OR NEW.document_id IS DISTINCT FROM OLD.document_id)
    EXECUTE FUNCTION document_search_version_high_water();

-- The marks themselves only rise. A mark goes only with its document (the cascade above):
-- deleting one by hand, lowering it or truncating the table would reopen the way back.
CREATE FUNCTION document_search_version_high_water_kept() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        IF NOT EXISTS (SELECT 1
                         FROM document d
                        WHERE d.tenant_id = OLD.tenant_id
                          AND d.document_id = OLD.document_id) THEN
            -- The document itself is being deleted (ON DELETE CASCADE): its mark goes too.
            RETURN OLD;
        END IF;
    END IF;
    RAISE EXCEPTION 'the search high-water mark of a document only rises (% refused)', TG_OP
        USING ERRCODE = 'check_violation',
              CONSTRAINT = 'document_search_version_forward_only';
END
$$;

CREATE TRIGGER document_search_version_high_water_kept
    BEFORE DELETE ON document_search_version_high_water
    FOR EACH ROW
    EXECUTE FUNCTION document_search_version_high_water_kept();

CREATE TRIGGER document_search_version_high_water_rises
    BEFORE UPDATE ON document_search_version_high_water
    FOR EACH ROW
    WHEN (NEW.version_number < OLD.version_number
          OR NEW.tenant_id IS DISTINCT FROM OLD.tenant_id
          OR NEW.document_id IS DISTINCT FROM OLD.document_id)
    EXECUTE FUNCTION document_search_version_high_water_kept();

CREATE TRIGGER document_search_version_high_water_not_truncated
    BEFORE TRUNCATE ON document_search_version_high_water
    FOR EACH STATEMENT
    EXECUTE FUNCTION document_search_version_high_water_kept();

-- 2. What chunked each generation, and when an indexer last registered it ----------------
--
-- chunking_code: the (name -> version) of our chunker and of the parsers, splitter and
-- tokenizer it ran with (services/indexer/pipeline/chunking_code.py); the strategy id
-- carries only a digest of it. NULL for generations registered before this migration: their
-- strategy ids have no digest, so they differ from any current one anyway.
-- registered_at: bumped by every indexer at start (PgVectorSink.ensure_generation). The
-- generation of a model registered last is what the indexers chunk with now: `kb index
-- check` reports documents served from another strategy of that model as chunked by older
-- code, and a re-run by those indexers (`--repair`) chunks them as they do.
ALTER TABLE index_generation
    ADD COLUMN chunking_code jsonb,
    ADD COLUMN registered_at timestamptz;

UPDATE index_generation SET registered_at = created_at;

ALTER TABLE index_generation
    ALTER COLUMN registered_at SET DEFAULT now(),
    ALTER COLUMN registered_at SET NOT NULL;
