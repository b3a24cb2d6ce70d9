"""The served ACL: the READ ACL search applies to a document (``document_acl``) is the one its
served version was published with (``document_version_acl``, migration 0024).

It changes in the transaction that moves the document's search pointer to another version
(the sink's switch, ``kb index generations switch``) and in a publish of the served version's
ACL (services/publisher): never before the version it belongs to is the one search serves,
so a version published with a wider ACL does not open the version still served to more
readers (issue 29, item 1).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from services.runtime.pg.db import translate_db_errors
from services.runtime.pg.sql import queries_beside

QUERIES = queries_beside(__file__, "served_acl.sql")


# A document named with its tenant.
TenantDocument = tuple[str, uuid.UUID]


async def apply_served_acl(conn: Any, tenant_id: str, document_ids: Sequence[uuid.UUID]) -> None:
    """Make ``document_ids``' served ACL their served version's; the caller's transaction
    holds their pointer rows (served_acl.sql says why)."""
    await apply_served_acls(conn, [(tenant_id, document_id) for document_id in document_ids])


async def apply_served_acls(conn: Any, documents: Sequence[TenantDocument]) -> None:
    """``apply_served_acl`` for documents of several tenants, in one statement."""
    await _run_for_documents(conn, "apply_served_acl", documents)


async def lock_first_pointer(conn: Any, tenant_id: str, document_ids: Sequence[uuid.UUID]) -> None:
    """Stand-in for the pointer rows of documents that have none yet (served_acl.sql:
    lock_first_pointer): taken by a publish that found no pointer and by the transactions
    that insert the first one."""
    await lock_first_pointers(conn, [(tenant_id, document_id) for document_id in document_ids])


async def lock_first_pointers(conn: Any, documents: Sequence[TenantDocument]) -> None:
    """``lock_first_pointer`` for documents of several tenants, in (tenant, document)
    order."""
    await _run_for_documents(conn, "lock_first_pointer", documents)


async def _run_for_documents(conn: Any, query: str, documents: Sequence[TenantDocument]) -> None:
    """One statement for all ``documents``: their tenants and their ids as two arrays."""
    if not documents:
        return
    with translate_db_errors():
        await conn.execute(
            QUERIES[query],
            [tenant_id for tenant_id, _ in documents],
            [document_id for _, document_id in documents],
        )
