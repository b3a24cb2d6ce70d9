-- name: tenant_tier
SELECT tier FROM tenant WHERE tenant_id = $1
