"""kb-client follows the document erase (issue 43), against the real server: an admin key
erases a published document (deleted first), the answer's token is remembered so the next
searches never return it, the status says DELETED with ``erasedAt``, a repeat answers the
same; a key without the admin scope gets ``Forbidden`` and nothing changes."""

from __future__ import annotations

import uuid

import asyncpg
import pytest
from kb_client import AsyncKbClient, Forbidden, IndexStatus, KbClient

from services.publisher.keys.store_pg import KeySpec, PgKeyStore
from services.runtime.auth.keys import Scope
from services.runtime.tenancy.tenant_auth import hash_api_key, new_api_key
from tests.support.api import ApiTenant

pytestmark = pytest.mark.integration

READ = ["group:all"]
WAIT = 120.0
TEXT = b"# Privacy\n\nAda Lovelace asked for her records to be erased.\n"


async def test_an_admin_key_erases_a_document_and_the_client_follows(
    server: str, indexer: None, tenant: ApiTenant
) -> None:
    async with AsyncKbClient(server, tenant.key) as kb:
        published = await kb.publish_file(TEXT, title="Privacy", filename="p.md", read=READ)
        await kb.wait_searchable(published.document_id, published.version_number, WAIT)

        erased = await kb.erase_document(published.document_id)
        assert erased.document_id == published.document_id
        assert erased.erased_at >= erased.requested_at
        assert kb.tokens.newest is not None

        after = await kb.search("records to be erased", principals=READ)
        assert published.document_id not in {hit.document_id for hit in after.results}
        status = await kb.document_status(published.document_id)
        assert status.index_status is IndexStatus.DELETED
        assert status.erased_at == erased.erased_at

        again = await kb.erase_document(published.document_id)
        assert (again.requested_at, again.erased_at) == (erased.requested_at, erased.erased_at)


async def test_a_key_without_the_admin_scope_is_forbidden(
    server: str, module_database: str, tenant: ApiTenant
) -> None:
    key = new_api_key(tenant.tenant_id)
    conn = await asyncpg.connect(module_database)
    try:
        await PgKeyStore(conn).create_key(
            tenant.tenant_id, hash_api_key(key), KeySpec(frozenset({Scope.PUBLISH}))
        )
    finally:
        await conn.close()
    with KbClient(server, tenant.key) as admin:
        created = admin.create_document(TEXT, title="Privacy", filename="p.md")
    with KbClient(server, key) as kb:
        with pytest.raises(Forbidden) as refused:
            kb.erase_document(created.document_id)
        assert refused.value.code == "KEY_SCOPE_INSUFFICIENT"
        with pytest.raises(Forbidden):
            kb.erase_document(uuid.uuid4())
    with KbClient(server, tenant.key) as admin:
        status = admin.document_status(created.document_id)
        assert status.index_status is not IndexStatus.DELETED
        assert status.erased_at is None
