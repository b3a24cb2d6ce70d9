"""What the framework retrievers share: who a search runs for, and a hit's metadata."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kb_client.models import SearchHitBody, SearchMode


@dataclass(frozen=True)
class SearchOptions:
    """A retriever's search: whose it is (``principals``, or an end user's signed
    ``principal_token``), how many hits and how they are found."""

    principals: Sequence[str] | None = None
    # A credential: left out of the repr.
    principal_token: str | None = field(default=None, repr=False)
    top_k: int = 4
    mode: SearchMode | str = SearchMode.HYBRID
    document_ids: Sequence[str] | None = None
    heading_prefix: Sequence[str] | None = None

    def given(
        self,
        principals: Sequence[str] | None = None,
        principal_token: str | None = None,
        top_k: int | None = None,
    ) -> SearchOptions:
        """These options, with a call's own principals or token (the one replaces the
        other) and top_k."""
        changed = self
        if principals is not None or principal_token is not None:
            changed = replace(changed, principals=principals, principal_token=principal_token)
        if top_k is not None:
            changed = replace(changed, top_k=top_k)
        return changed

    def arguments(self) -> dict[str, Any]:
        return {
            "principals": self.principals,
            "principal_token": self.principal_token,
            "top_k": self.top_k,
            "mode": self.mode,
            "document_ids": self.document_ids,
            "heading_prefix": self.heading_prefix,
        }


def hit_metadata(hit: SearchHitBody) -> dict[str, Any]:
    """The metadata each framework's document or node carries."""
    return {
        "document_id": str(hit.document_id),
        "version": hit.version_number,
        "title": hit.title,
        "heading_path": list(hit.heading_path),
        "chunk_id": hit.chunk_id,
        "score": hit.score,
        "media_type": hit.media_type,
    }
