"""A LlamaIndex retriever over kb search: ``pip install kb-client[llamaindex]``.

retriever = KbLlamaRetriever(client=KbClient(url, key), principals=["group:all"])
nodes = retriever.retrieve("how long do refunds take?")
nodes = retriever.for_principal_token(user_token).retrieve("...")  # per call
nodes = await retriever.aretrieve("...")  # with async_client=AsyncKbClient(...)
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from llama_index.core.retrievers import BaseRetriever
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

from kb_client.aio import AsyncKbClient
from kb_client.client import KbClient
from kb_client.models import SearchMode, SearchResponse
from kb_client.retrieval import SearchOptions, hit_metadata


class KbLlamaRetriever(BaseRetriever):
    """Search results as LlamaIndex ``NodeWithScore`` s (a ``TextNode`` per chunk, its id
    the chunk id; metadata: document_id, version, title, heading_path, chunk_id, score,
    media_type).
    ``retrieve`` takes only the query: ``for_principals`` / ``for_principal_token`` give a
    retriever for one caller, sharing the client."""

    def __init__(
        self,
        *,
        client: KbClient | None = None,
        async_client: AsyncKbClient | None = None,
        principals: Sequence[str] | None = None,
        principal_token: str | None = None,
        top_k: int = 4,
        mode: SearchMode | str = SearchMode.HYBRID,
        document_ids: Sequence[str] | None = None,
        heading_prefix: Sequence[str] | None = None,
    ) -> None:
        super().__init__()
        self._client = client
        self._async_client = async_client
        self._options = SearchOptions(
            principals, principal_token, top_k, mode, document_ids, heading_prefix
        )

    def __repr__(self) -> str:
        return f"KbLlamaRetriever({self._options!r})"

    def for_principals(self, principals: Sequence[str]) -> KbLlamaRetriever:
        return self._with(self._options.given(principals=principals))

    def for_principal_token(self, token: str) -> KbLlamaRetriever:
        return self._with(self._options.given(principal_token=token))

    def _with(self, options: SearchOptions) -> KbLlamaRetriever:
        copy = KbLlamaRetriever(client=self._client, async_client=self._async_client)
        copy._options = options
        return copy

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        if self._client is None:
            raise ValueError("KbLlamaRetriever.retrieve needs client=KbClient(...)")
        return _nodes(self._client.search(query_bundle.query_str, **self._options.arguments()))

    async def _aretrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        query, arguments = query_bundle.query_str, self._options.arguments()
        if self._async_client is not None:
            return _nodes(await self._async_client.search(query, **arguments))
        if self._client is None:
            raise ValueError("KbLlamaRetriever.aretrieve needs async_client= or client=")
        client = self._client
        return _nodes(await asyncio.to_thread(lambda: client.search(query, **arguments)))


def _nodes(answer: SearchResponse) -> list[NodeWithScore]:
    return [
        NodeWithScore(
            node=TextNode(id_=hit.chunk_id, text=hit.text, metadata=hit_metadata(hit)),
            score=hit.score,
        )
        for hit in answer.results
    ]


__all__ = ["KbLlamaRetriever"]
