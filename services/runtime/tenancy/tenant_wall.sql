-- name: full_text_match_is_leakproof
-- Whether the full-text match operator's function (tsvector @@ tsquery) is LEAKPROOF in this
-- database: behind row security, only then may a keyword search use the full-text index
-- (services/runtime/tenancy/tenant_wall.py; migration 0029 marks it when run by a superuser).
SELECT p.proleakproof
  FROM pg_proc p
 WHERE p.oid = 'pg_catalog.ts_match_vq(tsvector, tsquery)'::regprocedure
