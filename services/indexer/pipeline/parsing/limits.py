"""What one document's parse may cost: the parsers check these as they go."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final


@dataclass(frozen=True)
class ParseLimits:
    max_decompressed_bytes: int = 256 * 1024 * 1024  # DOCX/zip bombs -> DOCUMENT_TOO_LARGE
    max_compression_ratio: float = 200.0
    # One archive member (a DOCX's word/document.xml): its XML is parsed whole, at some
    # 15-20x its size in memory, so one member is held to less than the whole archive.
    max_member_bytes: int = 64 * 1024 * 1024
    budget_seconds: float = 120.0  # wall time of parse+chunk -> DOCUMENT_PARSE_TIMEOUT
    # Address space of each parse process (RLIMIT_AS, set at its start; 0: no limit). Past
    # it an allocation fails: MemoryError, or the process dies -> DOCUMENT_TOO_LARGE.
    memory_limit_bytes: int = 1024 * 1024 * 1024


# A parse that failed after this process's address space peaked this close to its limit
# (RLIMIT_AS) failed for memory, whatever its library said (lxml reports a failed
# allocation as an XMLSyntaxError "unknown error" or "Memory allocation failed"). The peak
# is the process's, not the document's: the pool replaces a process whose peak came this
# close (parsing.pool), so it is the peak of the document at hand.
NEAR_LIMIT: Final = 0.75


def memory_limit() -> int | None:
    """This process's address-space limit (RLIMIT_AS soft), or None if it has none."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    except (ImportError, AttributeError, ValueError, OSError):
        return None
    return None if soft == resource.RLIM_INFINITY else soft


def peak_address_space(pid: int | None = None) -> int | None:
    """A process's (this one's by default) largest address space so far (Linux)."""
    try:
        with open(f"/proc/{pid or 'self'}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmPeak:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def near_memory_limit() -> int | None:
    """This process's address-space limit if it has one and came within reach of it."""
    limit = memory_limit()
    if limit is None:
        return None
    peak = peak_address_space()
    return limit if peak is not None and peak >= NEAR_LIMIT * limit else None
