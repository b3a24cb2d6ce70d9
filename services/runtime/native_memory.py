"""glibc's malloc, told to give memory back: the indexer handles 50 MB documents and a
model's activations, and glibc otherwise keeps freed pages mapped (in an arena per thread)
long after they were used. Both calls are no-ops off glibc."""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Any, Final

# mallopt's parameter number for the arena limit (glibc malloc.h).
_M_ARENA_MAX: Final = -8


def _glibc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018 - both exist on glibc only
    except (OSError, AttributeError):
        return None
    return libc


_LIBC: Final = _glibc()


def release_freed_memory() -> None:
    """Returns the free pages of every arena to the system."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def limit_malloc_arenas(arenas: int = 2) -> None:
    """Caps glibc's malloc arenas unless MALLOC_ARENA_MAX says otherwise. Every thread that
    allocates gets an arena of its own (up to 8 per core), and each keeps the freed memory
    of its last big allocation: onnxruntime's threads and the inference threads kept
    their freed activations (BENCHMARKS.md)."""
    if _LIBC is not None and not os.environ.get("MALLOC_ARENA_MAX"):
        _LIBC.mallopt(_M_ARENA_MAX, arenas)
