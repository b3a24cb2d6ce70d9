"""Tenant credentials beyond the key check itself (docs/security.md): key scopes and
principal sources (``keys``), principal tokens (``tokens``), failed-key throttling
(``throttle``) and their settings. The middleware and the route dependencies are
services/runtime/tenancy/tenant_auth.py."""
