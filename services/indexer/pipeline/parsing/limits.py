"""What one document's parse may cost: the parsers check these as they go."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParseLimits:
    max_decompressed_bytes: int = 256 * 1024 * 1024  # DOCX/zip bombs -> DOCUMENT_TOO_LARGE
    max_compression_ratio: float = 200.0
    budget_seconds: float = 120.0  # wall time of parse+chunk -> DOCUMENT_PARSE_TIMEOUT
