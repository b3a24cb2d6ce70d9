"""kb-client against the real server (issue 45): a document uploaded, published and waited
for until searchable, found by a search that carries the token the wait returned; a new
version, a bulk request, the status and the index task; sync and async alike."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from kb_client import (
    AsyncKbClient,
    BulkItem,
    IndexingFailed,
    IndexStatus,
    KbClient,
    SearchMode,
    TaskStatus,
)
from kb_client._core import token_position

from tests.support.api import ApiTenant
from tests.support.documents import DocSection, make_corrupt_pdf, make_html
from tests.support.stack import REPO_ROOT

pytestmark = pytest.mark.integration

POLICY = REPO_ROOT / "examples" / "refund-policy" / "v1.md"
READ = ["group:all"]
WAIT = 120.0


async def test_the_async_client_publishes_waits_and_finds(
    server: str, indexer: None, tenant: ApiTenant
) -> None:
    async with AsyncKbClient(server, tenant.key) as kb:
        published = await kb.publish_file(POLICY, read=READ, timeout=WAIT)
        assert published.version_number == 1
        assert published.status.index_status is IndexStatus.SEARCHABLE
        assert published.search_token is not None
        # The client remembers the token; its searches pass it as `after` from now on.
        assert kb.tokens.newest is not None
        assert token_position(kb.tokens.newest) >= token_position(published.search_token)

        found = await kb.search("how many days to return an item", principals=READ, top_k=3)
        assert found.results
        hit = found.results[0]
        assert (hit.document_id, hit.version_number) == (published.document_id, 1)
        assert hit.heading_path
        assert hit.chunk_id
        assert hit.text
        assert found.degraded is None
        keyword = await kb.search("refund", principals=READ, mode=SearchMode.KEYWORD)
        assert {h.document_id for h in keyword.results} == {published.document_id}
        nobody = await kb.search("refund", principals=["group:nobody"])
        assert nobody.results == []

        # A second version, waited for through its document id.
        v2 = await kb.add_version(
            published.document_id, b"# Refunds\n\nSixty days now.\n", filename="v2.md"
        )
        again = await kb.publish_and_wait(
            v2.document_id, v2.version_number, revision=v2.revision, read=READ, timeout=WAIT
        )
        assert again.version_number == 2
        status = await kb.document_status(published.document_id)
        assert (status.search_version, status.revision) == (2, again.revision)
        assert status.index_task_id is not None
        task = await kb.index_task(status.index_task_id)
        assert (task.version_number, task.status) == (2, TaskStatus.SUCCEEDED)


async def test_the_sync_client_does_the_same(server: str, indexer: None, tenant: ApiTenant) -> None:
    def run() -> tuple[uuid.UUID, list[uuid.UUID], int]:
        with KbClient(server, tenant.key) as kb:
            published = kb.publish_file(
                b"# Shipping\n\nParcels leave the warehouse within two days.\n",
                title="Shipping",
                filename="shipping.md",
                read=READ,
                timeout=WAIT,
            )
            bulk = kb.publish_many(
                [
                    BulkItem(b"Gift cards never expire.", READ, title="Gift cards"),
                    BulkItem(
                        b"Parcels leave within one day.", READ, document_id=published.document_id
                    ),
                ]
            )
            assert (bulk.published, bulk.refused) == (2, 0), bulk
            for result in bulk.results:
                assert result.document_id is not None
                assert result.version_number is not None
                kb.wait_searchable(result.document_id, result.version_number, timeout=WAIT)
            found = kb.search("warehouse parcels", principals=READ, mode="keyword")
            return (
                published.document_id,
                [h.document_id for h in found.results],
                found.results[0].version_number,
            )

    document_id, found, version = await asyncio.to_thread(run)
    assert found == [document_id]
    assert version == 2


async def test_each_hit_names_its_versions_media_type(
    server: str, indexer: None, tenant: ApiTenant
) -> None:
    # Issue 45: a retriever's metadata names the media type of the hit's version, the one
    # its upload was stored with.
    page = make_html(
        (DocSection(1, "Lantern care", ("Lantern wicks are trimmed every week.",)),),
        noise=False,
    )
    async with AsyncKbClient(server, tenant.key) as kb:
        markdown = await kb.publish_file(
            b"# Lantern oil\n\nLantern oil is stored in the cellar.\n",
            filename="oil.md",
            read=READ,
            timeout=WAIT,
        )
        html = await kb.publish_file(page, filename="care.html", read=READ, timeout=WAIT)
        for mode in SearchMode:
            found = await kb.search("lantern", principals=READ, mode=mode, top_k=10)
            assert {(h.document_id, h.media_type) for h in found.results} == {
                (markdown.document_id, "text/markdown"),
                (html.document_id, "text/html"),
            }, mode


async def test_a_wait_for_a_version_that_fails_raises_its_code(
    server: str, indexer: None, tenant: ApiTenant
) -> None:
    async with AsyncKbClient(server, tenant.key) as kb:
        with pytest.raises(IndexingFailed) as caught:
            await kb.publish_file(
                make_corrupt_pdf(), filename="broken.pdf", read=READ, timeout=WAIT
            )
    assert caught.value.code == "DOCUMENT_PARSE_FAILED"
    assert caught.value.version == 1
