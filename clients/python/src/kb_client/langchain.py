"""A LangChain retriever over kb search: ``pip install kb-client[langchain]``.

retriever = KbRetriever(client=KbClient(url, key), principals=["group:all"])
docs = retriever.invoke("how long do refunds take?")
docs = retriever.invoke("...", principal_token=user_token)  # per call
docs = await retriever.ainvoke("...")  # with async_client=AsyncKbClient(...)
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from langchain_core.callbacks import (
    AsyncCallbackManagerForRetrieverRun,
    CallbackManagerForRetrieverRun,
)
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from pydantic import ConfigDict, Field

from kb_client.aio import AsyncKbClient
from kb_client.client import KbClient
from kb_client.models import SearchMode, SearchResponse
from kb_client.retrieval import SearchOptions, hit_metadata


class KbRetriever(BaseRetriever):
    """Search results as LangChain ``Document`` s (metadata: document_id, version, title,
    heading_path, chunk_id, score, media_type). Give ``client`` for ``invoke``, ``async_client`` for
    ``ainvoke`` (without it, ``ainvoke`` runs the sync client in a thread)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    client: KbClient | None = None
    async_client: AsyncKbClient | None = None
    principals: list[str] | None = None
    principal_token: str | None = Field(default=None, repr=False)
    top_k: int = 4
    mode: SearchMode = SearchMode.HYBRID
    document_ids: list[str] | None = None
    heading_prefix: list[str] | None = None

    def _options(
        self,
        principals: Sequence[str] | None,
        principal_token: str | None,
        top_k: int | None,
    ) -> SearchOptions:
        base = SearchOptions(
            self.principals,
            self.principal_token,
            self.top_k,
            self.mode,
            self.document_ids,
            self.heading_prefix,
        )
        return base.given(principals, principal_token, top_k)

    def _get_relevant_documents(
        self,
        query: str,
        *,
        run_manager: CallbackManagerForRetrieverRun,
        principals: Sequence[str] | None = None,
        principal_token: str | None = None,
        top_k: int | None = None,
    ) -> list[Document]:
        if self.client is None:
            raise ValueError("KbRetriever.invoke needs client=KbClient(...)")
        options = self._options(principals, principal_token, top_k)
        return _documents(self.client.search(query, **options.arguments()))

    async def _aget_relevant_documents(
        self,
        query: str,
        *,
        run_manager: AsyncCallbackManagerForRetrieverRun,
        principals: Sequence[str] | None = None,
        principal_token: str | None = None,
        top_k: int | None = None,
    ) -> list[Document]:
        options = self._options(principals, principal_token, top_k)
        if self.async_client is not None:
            return _documents(await self.async_client.search(query, **options.arguments()))
        if self.client is None:
            raise ValueError("KbRetriever.ainvoke needs async_client= or client=")
        client = self.client
        answer = await asyncio.to_thread(lambda: client.search(query, **options.arguments()))
        return _documents(answer)


def _documents(answer: SearchResponse) -> list[Document]:
    return [
        Document(page_content=hit.text, metadata=hit_metadata(hit), id=hit.chunk_id)
        for hit in answer.results
    ]


__all__ = ["KbRetriever"]
