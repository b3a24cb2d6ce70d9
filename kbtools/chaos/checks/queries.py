"""The checks' SQL (``checks.sql``), loaded once, as the services load theirs."""

from __future__ import annotations

from services.runtime.pg.sql import queries_beside

QUERIES = queries_beside(__file__, "checks.sql")
