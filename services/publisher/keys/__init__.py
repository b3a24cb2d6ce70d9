"""Tenant API keys and principal-token verification keys, as `kb tenants keys` and
`kb tenants verification-keys` manage them (docs/security.md)."""
