"""kb-client follows the document delete (issues 45 and 43), against the real server: a
delete answers its revision, ``deletedAt`` and a search token the client remembers, so its
next searches never return the document; a repeat answers the same; a stale revision is a
typed conflict; the status says DELETED; a bulk delete item; waiting on a deleted document,
or publishing to one, raises ``DocumentDeleted`` at once; a delete is retried like a
publish."""

from __future__ import annotations

import uuid

import pytest
from kb_client import (
    AsyncKbClient,
    BulkDelete,
    BulkItem,
    DocumentDeleted,
    IndexStatus,
    KbClient,
    RetryPolicy,
    RevisionConflict,
    TransportError,
)
from kb_client._core import token_position

from tests.client.test_problems import CountingSync
from tests.support.api import ApiTenant, free_port

pytestmark = pytest.mark.integration

READ = ["group:all"]
WAIT = 120.0
TEXT = b"# Returns\n\nItems may be returned within thirty days of delivery.\n"


async def test_a_delete_leaves_search_for_the_clients_next_search(
    server: str, indexer: None, tenant: ApiTenant
) -> None:
    async with AsyncKbClient(server, tenant.key) as kb:
        published = await kb.publish_file(TEXT, title="Returns", filename="r.md", read=READ)
        found = await kb.search("returned within thirty days", principals=READ)
        assert published.document_id in {hit.document_id for hit in found.results}

        deleted = await kb.delete_document(published.document_id, revision=published.revision)
        assert deleted.document_id == published.document_id
        assert deleted.revision > published.revision
        # The delete's token is remembered: the next searches pass it as `after`.
        assert kb.tokens.newest is not None
        assert token_position(kb.tokens.newest) >= token_position(deleted.search_token)
        assert kb.tokens.after(None) == [kb.tokens.newest]

        after = await kb.search("returned within thirty days", principals=READ)
        assert published.document_id not in {hit.document_id for hit in after.results}

        status = await kb.document_status(published.document_id)
        assert status.index_status is IndexStatus.DELETED
        assert status.deleted_at == deleted.deleted_at
        assert status.revision == deleted.revision

        # A repeat (a retry after a lost answer) answers what the delete did, with either
        # revision, and changes nothing.
        again = await kb.delete_document(published.document_id, revision=published.revision)
        assert (again.revision, again.deleted_at) == (deleted.revision, deleted.deleted_at)
        again = await kb.delete_document(published.document_id, revision=deleted.revision)
        assert (again.revision, again.deleted_at) == (deleted.revision, deleted.deleted_at)


async def test_a_stale_revision_is_a_revision_conflict(
    server: str, indexer: None, tenant: ApiTenant
) -> None:
    async with AsyncKbClient(server, tenant.key) as kb:
        created = await kb.create_document(TEXT, title="Stale", filename="s.md")
        newer = await kb.add_version(created.document_id, TEXT, filename="s2.md")
        with pytest.raises(RevisionConflict) as stale:
            await kb.delete_document(created.document_id, revision=created.revision)
        assert stale.value.current_revision == newer.revision
        status = await kb.document_status(created.document_id)
        assert status.index_status is not IndexStatus.DELETED
        assert status.deleted_at is None


async def test_waiting_on_or_publishing_to_a_deleted_document_raises_at_once(
    server: str, indexer: None, tenant: ApiTenant
) -> None:
    async with AsyncKbClient(server, tenant.key) as kb:
        published = await kb.publish_file(TEXT, title="Gone", filename="g.md", read=READ)
        await kb.delete_document(published.document_id, revision=published.revision)
        # Without the check these waits ran to their timeout (DeadlineExceeded).
        with pytest.raises(DocumentDeleted):
            await kb.wait_searchable(published.document_id, 1, timeout=WAIT)

        created = await kb.create_document(TEXT, title="Never served", filename="n.md")
        await kb.delete_document(created.document_id, revision=created.revision)
        with pytest.raises(DocumentDeleted):
            await kb.wait_searchable(created.document_id, 1, timeout=WAIT)
        with pytest.raises(DocumentDeleted) as refused:
            await kb.publish_and_wait(
                created.document_id, 1, revision=created.revision + 1, read=READ, timeout=WAIT
            )
        assert (refused.value.status, refused.value.code) == (409, "DOCUMENT_DELETED")
        with pytest.raises(DocumentDeleted):
            await kb.add_version(created.document_id, TEXT, filename="n2.md")


def test_the_sync_client_deletes_through_a_bulk_item(
    server: str, indexer: None, tenant: ApiTenant
) -> None:
    with KbClient(server, tenant.key) as kb:
        kept = kb.create_document(TEXT, title="Kept", filename="k.md")
        gone = kb.create_document(TEXT, title="Gone", filename="g.md")
        answer = kb.publish_many(
            [
                BulkDelete(gone.document_id, revision=gone.revision),
                BulkItem(TEXT, READ, document_id=kept.document_id, filename="k2.md"),
            ]
        )
        assert (answer.published, answer.deleted, answer.refused) == (1, 1, 0)
        deleted, published = answer.results
        assert (deleted.index, deleted.status, deleted.document_id) == (0, 200, gone.document_id)
        assert deleted.deleted_at is not None
        assert (published.status, published.version_number) == (202, 2)
        assert kb.document_status(gone.document_id).index_status is IndexStatus.DELETED

        # The single call on a deleted document: the same delete, sync.
        single = kb.delete_document(gone.document_id, revision=gone.revision)
        assert single.deleted_at == deleted.deleted_at
        assert kb.tokens.newest is not None
        assert token_position(kb.tokens.newest) >= token_position(single.search_token)


def test_a_delete_is_retried_like_a_publish() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    policy = RetryPolicy(max_attempts=3, base_delay=0.01, deadline_seconds=10)
    transport = CountingSync()
    key = f"kb.acme.{uuid.uuid4().hex}"
    with KbClient(url, key, retry=policy, transport=transport) as kb, pytest.raises(TransportError):
        kb.delete_document(uuid.uuid4(), revision=3)
    assert len(transport.sent) == 3
