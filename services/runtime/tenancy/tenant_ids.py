"""What a tenant id may be: lower-case letters, digits and hyphens, up to 63 characters
(a DNS label). The publisher refuses any other at its door, and the indexer relies on it
where a tenant id goes into DDL as a literal (a tenant's own ANN index)."""

from __future__ import annotations

from typing import Final

TENANT_ID_PATTERN: Final = r"^[a-z0-9][a-z0-9-]{0,62}$"
