-- Row-level security as a second wall between tenants (issue 29; docs/security.md, "The second
-- wall").
--
-- Every query of the API already names its tenant. This makes the database refuse the rows
-- of other tenants too, for the API's tenant-scoped transactions: they run as the role
-- kb_tenant_api (SET LOCAL ROLE) with the tenant in the transaction-local setting
-- kb.tenant_id (services/runtime/tenancy/tenant_wall.py), and each tenant-scoped table lets that
-- role see and write only the rows of that tenant. A query that lost its tenant filter then
-- reads nothing of another tenant, and an insert naming another tenant is refused.
--
-- Why a role of its own: the owner of the tables and a superuser bypass row security (the
-- embedded PostgreSQL and most deployments connect as one of them), and the relay, the
-- indexers, migrations and the operator are cross-tenant by design and stay so. Nothing is
-- FORCEd: the owner sees every row, as before. The role logs in never; the connecting role
-- becomes it inside a transaction, which needs membership (granted below to the migrating
-- role; docs/security.md says what to grant on managed PostgreSQL when the API connects as
-- another role).
--
-- Roles are cluster-wide: the role is created only when absent (tests migrate many databases
-- in one cluster, and an operator may have created it beforehand, when the migrating role
-- lacks CREATEROLE).
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'kb_tenant_api') THEN
        CREATE ROLE kb_tenant_api NOLOGIN NOBYPASSRLS;
    END IF;
END
$$;

-- The migrating role becomes able to SET ROLE to it, unless it already is (a superuser, or
-- a role an operator granted it to when creating it: granting needs ADMIN on the role, which
-- such a migrating role may lack).
DO $$
BEGIN
    IF NOT pg_has_role(current_user, 'kb_tenant_api', 'SET') THEN
        GRANT kb_tenant_api TO CURRENT_USER;
    END IF;
END
$$;

-- Exactly what the API's tenant paths do as the role: search (read the pointers, the served
-- ACL, the chunks, the document's title, the tenant's text search configuration), a
-- document's status and its index task (read), a new document or version and a publish
-- (services/publisher/queries.sql, services/runtime/indexing/tasks.sql, served_acl.sql, outbox.sql:
-- the outbox's trigger reads relay_doorbell; a publish enqueues the tasks of the
-- generations the tenant is built in, read from the two generation tables). No DELETE of
-- documents, no TRUNCATE, nothing on the keys, the queue's leases or the relay's state.
-- SELECT ... FOR UPDATE of the search pointer (lock_search_pointer) needs UPDATE.
GRANT SELECT ON tenant, knowledge_chunk, tenant_search_generation, search_generation,
                relay_doorbell
   TO kb_tenant_api;
GRANT SELECT, INSERT, UPDATE ON document, document_version TO kb_tenant_api;
GRANT SELECT, INSERT, DELETE ON document_version_acl, document_acl TO kb_tenant_api;
GRANT SELECT, UPDATE ON document_search_version TO kb_tenant_api;
GRANT SELECT, INSERT ON index_task, outbox TO kb_tenant_api;
GRANT USAGE ON SEQUENCE outbox_position_seq TO kb_tenant_api;

-- One policy per table with a tenant_id column (a partitioned table's policy holds for its
-- partitions when they are read through it; the role has no privilege on a partition itself,
-- so it cannot read one around the policy). tests/integration/test_schema_tenant_keys.py
-- fails for a tenant-scoped table without it.
--
-- current_setting() is STABLE: where a statement names its tenant (every statement of the
-- API does), the planner joins the two equalities and checks the setting once, as a
-- one-time filter of the plan, no cost per row; where it does not, the setting is an index
-- condition, read once per scan. (A sub-select, the usual advice, gave the same plans with
-- an InitPlan per table to plan: BENCHMARKS.md, tenant wall.) No tenant set (NULL, or ''
-- once the setting was used in the session): no row matches.
DO $$
DECLARE
    scoped text;
BEGIN
    FOR scoped IN
        SELECT c.relname
          FROM pg_class AS c
         WHERE c.relnamespace = current_schema()::regnamespace
           AND c.relkind IN ('r', 'p')
           AND NOT c.relispartition
           AND EXISTS (SELECT 1 FROM pg_attribute AS a
                        WHERE a.attrelid = c.oid AND a.attname = 'tenant_id'
                          AND NOT a.attisdropped)
         ORDER BY c.relname
    LOOP
        EXECUTE format('ALTER TABLE %I ENABLE ROW LEVEL SECURITY', scoped);
        EXECUTE format(
            'CREATE POLICY tenant_wall ON %I AS PERMISSIVE FOR ALL TO kb_tenant_api'
            ' USING (tenant_id = current_setting(''kb.tenant_id'', true))'
            ' WITH CHECK (tenant_id = current_setting(''kb.tenant_id'', true))',
            scoped);
    END LOOP;
END
$$;

-- Behind row security a statement's own conditions on a table are evaluated before the
-- policy's, and used as index conditions, only when their functions are LEAKPROOF. The
-- full-text match (tsvector @@ tsquery) is not marked so by PostgreSQL: behind the wall the
-- keyword list could not start from the GIN index of its tenant's words, and a keyword or
-- hybrid search of a principal who may read most of the tenant took 1.3-1.5x as long at p95
-- (BENCHMARKS.md, tenant wall). Its only effect is its boolean answer, from its two
-- arguments, so we mark it, in this database only (pg_proc is per database). Only a
-- superuser may; without one (managed PostgreSQL) it stays unmarked, and KB_DB_ROW_SECURITY=auto
-- leaves search outside the wall there (services/runtime/tenancy/tenant_wall.py). A restore into
-- a new cluster (pg_dump, pg_upgrade) does not carry the mark: docs/security.md.
DO $$
BEGIN
    IF (SELECT r.rolsuper FROM pg_roles AS r WHERE r.rolname = current_user) THEN
        ALTER FUNCTION pg_catalog.ts_match_vq(tsvector, tsquery) LEAKPROOF;
    END IF;
END
$$;
