-- The READ ACL of each document version (issue 29, item 1; docs/architecture.md#tables).
--
-- Before: the ACL belonged to the document (document_acl), and a publish replaced it at
-- once. A version published with a wider ACL than the one served (v1 HR-only and served; v2,
-- a public rewrite, published with read `everyone`) let everyone read v1's text from the
-- publish's commit on -- for ever if v2 never indexed.
--
-- Now a publish writes the version's ACL here, and document_acl becomes the SERVED ACL, the
-- one search reads: the ACL of the version the document's search pointer
-- (document_search_version) serves. It is replaced from this table in the transaction that
-- moves the pointer to another version (the sink's switch, `kb index generations switch`),
-- and by a publish only when the version it publishes is the one served (an ACL-only
-- re-publish applies at once).
CREATE TABLE document_version_acl (
    tenant_id       text    NOT NULL,
    document_id     uuid    NOT NULL,
    version_number  integer NOT NULL,
    principal       text    NOT NULL CHECK (length(principal) BETWEEN 1 AND 200),
    permission      text    NOT NULL CHECK (permission IN ('READ')),
    PRIMARY KEY (tenant_id, document_id, version_number, principal, permission),
    FOREIGN KEY (tenant_id, document_id, version_number)
        REFERENCES document_version (tenant_id, document_id, version_number) ON DELETE CASCADE
);

-- Backfill: until now the document's ACL applied to whichever version search served, so it
-- is the ACL of every published version that can still be served: the published version,
-- the served one, and those between them (a pointer only moves forward, so older versions
-- are never served again). A version left without rows here would be served to nobody.
INSERT INTO document_version_acl (tenant_id, document_id, version_number, principal,
                                  permission)
SELECT a.tenant_id, a.document_id, v.version_number, a.principal, a.permission
  FROM document_acl a
  JOIN document_version v
    ON v.tenant_id = a.tenant_id
   AND v.document_id = a.document_id
   AND v.status = 'PUBLISHED'
  LEFT JOIN document_search_version s
    ON s.tenant_id = a.tenant_id
   AND s.document_id = a.document_id
 WHERE v.version_number >= coalesce(s.version_number, 1);
