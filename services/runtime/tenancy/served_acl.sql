-- The served ACL (document_acl, the one search reads) made the ACL of the version the
-- document's search pointer serves (document_version_acl, migration 0024), said once for the
-- transactions that move a pointer or publish the served version's ACL, which run it through
-- served_acl.py: the sink's switch (services/indexer/sink/pgvector.py), `kb index generations
-- switch` (services/indexer/generations/switch.py) and the publish
-- (services/publisher/store_pg.py).

-- name: apply_served_acl
-- $1 tenants, $2 documents: one (tenant, document) pair per element. Run by a transaction
-- that holds the documents' pointer rows (locked FOR UPDATE, or updated by it): publish and
-- completion serialise there, so no other transaction writes these documents' served ACL
-- meanwhile. One statement: the rows the served version's ACL does not hold are deleted,
-- those it holds are added (a row already there is left as it is: no dead tuple, no index
-- entry, for an unchanged principal). The deleted and the inserted rows never share a key,
-- so the sibling statements cannot meet. A document without a pointer keeps its rows
-- (nothing of it is served).
WITH asked AS (
    SELECT DISTINCT tenant_id, document_id
      FROM unnest($1::text[], $2::uuid[]) AS k (tenant_id, document_id)
), served AS (
    SELECT v.tenant_id, v.document_id, v.principal, v.permission
      FROM asked k
      JOIN document_search_version s
        ON s.tenant_id = k.tenant_id
       AND s.document_id = k.document_id
      JOIN document_version_acl v
        ON v.tenant_id = s.tenant_id
       AND v.document_id = s.document_id
       AND v.version_number = s.version_number
), gone AS (
    DELETE FROM document_acl a
     USING asked k
     WHERE a.tenant_id = k.tenant_id
       AND a.document_id = k.document_id
       AND EXISTS (SELECT 1
                     FROM document_search_version s
                    WHERE s.tenant_id = a.tenant_id
                      AND s.document_id = a.document_id)
       AND NOT EXISTS (SELECT 1
                         FROM served n
                        WHERE n.tenant_id = a.tenant_id
                          AND n.document_id = a.document_id
                          AND n.principal = a.principal
                          AND n.permission = a.permission)
)
INSERT INTO document_acl (tenant_id, document_id, principal, permission)
SELECT tenant_id, document_id, principal, permission
  FROM served
ON CONFLICT DO NOTHING

-- name: lock_first_pointer
-- $1 tenants, $2 documents: one (tenant, document) pair per element; a transaction-scoped
-- lock per document standing in for the pointer row while the document has none. A publish
-- that finds no pointer row (its FOR UPDATE locks nothing) takes it, and so does a
-- transaction giving the document its first pointer (the sink's first switch, before it,
-- in the same statement: sink.sql's switch_search_version includes this one;
-- `kb index generations switch`, after inserting it and before apply_served_acl). Without
-- it, a publish changing the ACL of the version whose first pointer commits at the same time
-- could apply its ACL to nothing (no pointer seen) while the switch applied the version's ACL
-- as it was before the publish (not yet committed): the served ACL would stay the old one.
-- With it, whichever comes second sees what the first committed (the publish reads the
-- pointer again after it). Taken in (tenant, document) order (the volatile call in the
-- target list is evaluated after the sort).
SELECT pg_advisory_xact_lock(
           hashtextextended('kb.first_search_pointer:' || k.tenant_id || ':' || k.document_id::text,
                            0))
  FROM unnest($1::text[], $2::uuid[]) AS k (tenant_id, document_id)
 ORDER BY k.tenant_id, k.document_id
