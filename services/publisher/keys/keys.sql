-- Key management for `kb tenants keys` and `kb tenants verification-keys`
-- (services/publisher/keys/store_pg.py). The API's own key checks are in
-- services/runtime/auth/keys.sql. Every query names the tenant.

-- name: tenant_exists
SELECT EXISTS (SELECT 1 FROM tenant WHERE tenant_id = $1)

-- name: insert_key
INSERT INTO tenant_api_key (key_id, tenant_id, key_hash, name, scopes, principal_source,
                            principals)
VALUES ($1, $2, $3, $4, $5::text[], $6, $7::text[])

-- name: list_keys
-- $2: the time that decides which keys are active (NULL: now()).
SELECT key_id, name, scopes, principal_source, principals, created_at, revoked_at,
       replaced_by,
       (revoked_at IS NULL OR revoked_at > coalesce($2::timestamptz, now())) AS active
  FROM tenant_api_key
 WHERE tenant_id = $1
 ORDER BY created_at, key_id

-- name: revoke_key
-- $3 when the key stops working (NULL: the database's now(), the clock the API's key
-- checks compare with, never that of the machine running `kb`). A key already revoked
-- keeps the earlier time: revoking twice never lengthens a rotation's grace period.
UPDATE tenant_api_key
   SET revoked_at = coalesce($3::timestamptz, now())
 WHERE tenant_id = $1
   AND key_id = $2
   AND (revoked_at IS NULL OR revoked_at > coalesce($3::timestamptz, now()))
RETURNING key_id

-- name: key_state
SELECT (revoked_at IS NULL OR revoked_at > coalesce($3::timestamptz, now())) AS active
  FROM tenant_api_key
 WHERE tenant_id = $1
   AND key_id = $2

-- name: lock_active_key
-- A rotation locks the key it replaces: two rotations of one key cannot both succeed
-- (the second finds it replaced and stops).
SELECT key_id, name, scopes, principal_source, principals
  FROM tenant_api_key
 WHERE tenant_id = $1
   AND key_id = $2
   AND replaced_by IS NULL
   AND (revoked_at IS NULL OR revoked_at > coalesce($3::timestamptz, now()))
   FOR UPDATE

-- name: mark_replaced
-- The old key works for $5 seconds more, counted from $4 (NULL: the database's now()); an
-- earlier revocation stands.
UPDATE tenant_api_key
   SET revoked_at = least(
           coalesce(revoked_at, 'infinity'),
           coalesce($4::timestamptz, now()) + make_interval(secs => $5::double precision)
       ),
       replaced_by = $3
 WHERE tenant_id = $1
   AND key_id = $2

-- name: insert_verification_key
INSERT INTO tenant_verification_key (tenant_id, kid, algorithm, key_material, audience, issuer)
VALUES ($1, $2, $3, $4, $5, $6)
ON CONFLICT (tenant_id, kid) DO NOTHING
RETURNING kid

-- name: list_verification_keys
-- Never the key material: a listing must not show an HMAC secret.
SELECT kid, algorithm, audience, issuer, created_at
  FROM tenant_verification_key
 WHERE tenant_id = $1
 ORDER BY kid

-- name: delete_verification_key
DELETE FROM tenant_verification_key
 WHERE tenant_id = $1
   AND kid = $2
RETURNING kid
