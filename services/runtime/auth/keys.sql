-- Tenant credentials as the API checks them (services/runtime/auth/keys.py). Every query
-- names the tenant: a key or a verification key is only ever looked for within the tenant
-- the request is for.

-- name: find_api_key
-- $1 tenant, $2 SHA-256 of the presented key, $3 the request's time (NULL: now()). A key
-- works until its revoked_at: `revoke` sets it to the database's now, `rotate
-- --grace-seconds` that far ahead of it (never the clock of the machine running `kb`). No
-- cache stands between this query and a request, so a revocation holds from the next one.
SELECT key_id, scopes, principal_source, principals
  FROM tenant_api_key
 WHERE tenant_id = $1
   AND key_hash = $2
   AND (revoked_at IS NULL OR revoked_at > coalesce($3::timestamptz, now()))

-- name: find_verification_key
-- $1 tenant, $2 the kid a principal token's header names.
SELECT kid, algorithm, key_material, audience, issuer
  FROM tenant_verification_key
 WHERE tenant_id = $1
   AND kid = $2
