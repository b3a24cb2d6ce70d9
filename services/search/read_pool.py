"""Which database a search reads: the pool chosen for the request (the primary, or a replica:
services/search/replicas.py), carried by a context variable from the route's choice down to
the connections of the index and of the serving-generation lookup, so that one request reads
one server and the code that reads needs no new argument at every level."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import asyncpg

_CHOSEN: ContextVar[asyncpg.Pool[Any] | None] = ContextVar("kb_search_read_pool", default=None)


def read_pool(default: asyncpg.Pool[Any]) -> asyncpg.Pool[Any]:
    """The pool chosen for this request, else ``default`` (the pool the reader was built
    with: the primary's)."""
    return _CHOSEN.get() or default


@contextmanager
def reading_from(pool: asyncpg.Pool[Any]) -> Iterator[None]:
    token = _CHOSEN.set(pool)
    try:
        yield
    finally:
        _CHOSEN.reset(token)
