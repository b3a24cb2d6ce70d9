"""kb-client's retrievers through their frameworks' own calls, against the real server
(issue 45): LangChain's `invoke` / `ainvoke` answer `Document`s and LlamaIndex's `retrieve`
/ `aretrieve` answer `NodeWithScore`s, each with the hit's metadata; the principals, or an
end user's signed principal token, are chosen per call and decide what is found."""

from __future__ import annotations

import asyncio
import time
import uuid

import asyncpg
import jwt
import pytest
from kb_client import AsyncKbClient, KbClient, Published
from kb_client.langchain import KbRetriever
from kb_client.llamaindex import KbLlamaRetriever
from langchain_core.documents import Document
from llama_index.core.schema import NodeWithScore

from services.publisher.keys.store_pg import PgKeyStore
from services.runtime.auth.tokens import checked_key_material
from tests.support.api import ApiTenant

pytestmark = pytest.mark.integration

WAIT = 120.0
QUERY = "warranty repairs"
HR, ALL = "group:hr", "group:all"
METADATA = {
    "document_id",
    "version",
    "title",
    "heading_path",
    "chunk_id",
    "score",
    "media_type",
}


async def _publish(server: str, tenant: ApiTenant) -> tuple[Published, Published]:
    async with AsyncKbClient(server, tenant.key) as kb:
        public = await kb.publish_file(
            b"# Warranty\n\n## Repairs\n\nWarranty repairs are free for two years.\n",
            filename="warranty.md",
            read=[ALL],
            timeout=WAIT,
        )
        private = await kb.publish_file(
            b"# Staff warranty\n\nStaff warranty repairs are free for five years.\n",
            filename="staff.md",
            read=[HR],
            timeout=WAIT,
        )
    return public, private


async def _token_for(module_database: str, tenant: ApiTenant, principals: list[str]) -> str:
    secret = uuid.uuid4().hex * 2
    conn = await asyncpg.connect(module_database)
    try:
        await PgKeyStore(conn).add_verification_key(
            tenant.tenant_id,
            "hs",
            "HS256",
            checked_key_material("HS256", secret.encode()),
            audience=None,
            issuer=None,
        )
    finally:
        await conn.close()
    now = int(time.time())
    claims = {
        "sub": "user:ann",
        "aud": f"kb:{tenant.tenant_id}",
        "iat": now,
        "exp": now + 600,
        "principals": principals,
    }
    return jwt.encode(claims, secret, "HS256", headers={"kid": "hs"})


def _found(documents: list[Document]) -> set[str]:
    return {d.metadata["document_id"] for d in documents}


def _nodes_found(nodes: list[NodeWithScore]) -> set[str]:
    return {n.node.metadata["document_id"] for n in nodes}


async def test_langchain_invoke_and_ainvoke(
    server: str, indexer: None, tenant: ApiTenant, module_database: str
) -> None:
    public, private = await _publish(server, tenant)
    token = await _token_for(module_database, tenant, [HR])
    public_id, private_id = str(public.document_id), str(private.document_id)

    def sync_calls() -> tuple[list[Document], list[Document], list[Document]]:
        with KbClient(server, tenant.key) as kb:
            retriever = KbRetriever(client=kb, principals=[ALL], top_k=5)
            return (
                retriever.invoke(QUERY),
                retriever.invoke(QUERY, principals=[HR, ALL]),
                retriever.invoke(QUERY, principal_token=token),
            )

    everyone, hr, by_token = await asyncio.to_thread(sync_calls)
    assert _found(everyone) == {public_id}
    assert _found(hr) == {public_id, private_id}
    assert _found(by_token) == {private_id}
    first = everyone[0]
    assert isinstance(first, Document)
    assert set(first.metadata) == METADATA
    assert first.metadata["version"] == 1
    assert first.metadata["heading_path"] == ["Warranty", "Repairs"]
    assert first.metadata["media_type"] == "text/markdown"
    assert first.id == first.metadata["chunk_id"]
    assert "Warranty repairs" in first.page_content

    async with AsyncKbClient(server, tenant.key) as kb:
        retriever = KbRetriever(async_client=kb, principals=[ALL])
        assert _found(await retriever.ainvoke(QUERY)) == {public_id}
        assert _found(await retriever.ainvoke(QUERY, principal_token=token)) == {private_id}
    assert token not in repr(KbRetriever(principal_token=token))


async def test_llamaindex_retrieve_and_aretrieve(
    server: str, indexer: None, tenant: ApiTenant, module_database: str
) -> None:
    public, private = await _publish(server, tenant)
    token = await _token_for(module_database, tenant, [HR])
    public_id, private_id = str(public.document_id), str(private.document_id)

    def sync_calls() -> tuple[list[NodeWithScore], list[NodeWithScore]]:
        with KbClient(server, tenant.key) as kb:
            retriever = KbLlamaRetriever(client=kb, principals=[ALL], top_k=5)
            return retriever.retrieve(QUERY), retriever.for_principals([HR]).retrieve(QUERY)

    everyone, hr = await asyncio.to_thread(sync_calls)
    assert _nodes_found(everyone) == {public_id}
    assert _nodes_found(hr) == {private_id}
    first = everyone[0]
    assert set(first.node.metadata) == METADATA
    assert first.score == first.node.metadata["score"]
    assert first.node.node_id == first.node.metadata["chunk_id"]
    assert first.node.metadata["heading_path"] == ["Warranty", "Repairs"]
    assert first.node.metadata["media_type"] == "text/markdown"
    assert "Warranty repairs" in first.node.get_content()

    async with AsyncKbClient(server, tenant.key) as kb:
        retriever = KbLlamaRetriever(async_client=kb, principals=[ALL])
        assert _nodes_found(await retriever.aretrieve(QUERY)) == {public_id}
        as_user = retriever.for_principal_token(token)
        assert _nodes_found(await as_user.aretrieve(QUERY)) == {private_id}
        assert token not in repr(as_user)
