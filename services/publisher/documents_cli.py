"""`kb documents delete`: a document taken out of search for good, as the API's DELETE does
(docs/architecture.md#document-lifecycle), for an operator acting on a tenant's request;
`kb documents erase`: its content erased, as the API's erase does.

Imports of drivers happen inside the command: `kb --help` does not pay for them.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING

import typer

from services.runtime.errors import BadInput

if TYPE_CHECKING:
    from services.publisher.domain import Publisher

documents_app = typer.Typer(help="A tenant's documents: delete or erase one.", no_args_is_help=True)


@documents_app.command("delete")
def delete_document(
    tenant: str = typer.Argument(help="The tenant id."),
    document: str = typer.Argument(help="The document id (a UUID)."),
    revision: int = typer.Option(
        ...,
        "--revision",
        min=1,
        help="The document revision you last read (its status's `revision`): a stale one "
        "is refused (REVISION_CONFLICT, exit 1).",
    ),
) -> None:
    """Delete a document: it leaves search at once, its ACL stops applying, its unfinished
    index tasks end (DOCUMENT_DELETED), a DocumentDeleted event is written. Deleting a
    deleted document prints what its delete did. Prints the answer as JSON: documentId,
    revision, deletedAt, searchToken."""
    from services.runtime.logging import get_logger

    document_id = _checked_ids(tenant, document)

    async def _delete(publisher: Publisher) -> dict[str, str | int]:
        result = await publisher.delete_document(tenant, document_id, expected_revision=revision)
        get_logger(__name__).info(
            "document.deleted" if result.changed else "document.delete_repeated",
            tenant_id=tenant,
            document_id=str(document_id),
            revision=result.revision,
            by="cli",
        )
        return {
            "documentId": str(result.document_id),
            "revision": result.revision,
            "deletedAt": result.deleted_at.isoformat(),
            "searchToken": result.search_token,
        }

    _print_answer(_delete)


def _print_answer(act: Callable[[Publisher], Awaitable[Mapping[str, str | int]]]) -> None:
    """Run ``act`` on a publisher over a small pool of its own, wired as the API's is (the
    pool is closed before ``act``'s answer is printed, as JSON)."""
    from services.publisher.domain import Publisher
    from services.publisher.settings import PublisherSettings
    from services.publisher.store_pg import PgPublisherStore, open_publisher_pool
    from services.runtime.commands.cli_support import load_settings, run_async
    from services.runtime.erasure.erase_pg import PgErasureStore
    from services.runtime.logging import configure_logging
    from services.runtime.tenancy.tenant_wall import walls_the_publisher

    settings = load_settings(PublisherSettings)
    configure_logging(settings.log_level, settings.log_format, service="kb-documents")

    async def _run() -> Mapping[str, str | int]:
        pool = await open_publisher_pool(settings, min_size=1, max_size=2)
        try:
            store = PgPublisherStore(
                pool, row_security=walls_the_publisher(settings.db_row_security)
            )
            return await act(
                Publisher(
                    store,
                    max_upload_bytes=settings.publisher_max_upload_bytes,
                    erasure=PgErasureStore(pool),
                    erase_batch_rows=settings.publisher_erase_batch_rows,
                )
            )
        finally:
            await pool.close()

    typer.echo(json.dumps(run_async(_run())))


def _checked_ids(tenant: str, document: str) -> uuid.UUID:
    """The document id, once both ids are well formed (BadInput, exit 2, otherwise)."""
    from services.runtime.tenancy.tenant_ids import TENANT_ID_PATTERN

    if not re.fullmatch(TENANT_ID_PATTERN, tenant):
        raise BadInput(f"tenant id {tenant!r} is invalid", code="TENANT_NAME_INVALID")
    try:
        return uuid.UUID(document)
    except ValueError:
        raise BadInput(
            f"document id {document!r} is not a UUID", code="DOCUMENT_ID_INVALID"
        ) from None


@documents_app.command("erase")
def erase_document(
    tenant: str = typer.Argument(help="The tenant id."),
    document: str = typer.Argument(help="The document id (a UUID)."),
) -> None:
    """Erase a document's content for good (a person's erasure request): a live document is
    deleted first, then every version's bytes, its chunks and embeddings in every
    generation, staged slices, its versions' ACLs, its tasks' error texts and the titles and
    principals of its outbox events go, in batches of KB_PUBLISHER_ERASE_BATCH_ROWS. An
    audit row stays (requested by "cli", no key). Erasing again finishes an erase that
    stopped halfway, or prints what it did. Prints the answer as JSON: documentId,
    deletedAt, requestedAt, erasedAt, searchToken."""
    from services.publisher.ports import ErasureRequest
    from services.runtime.logging import get_logger

    document_id = _checked_ids(tenant, document)

    async def _erase(publisher: Publisher) -> dict[str, str | int]:
        result = await publisher.erase_document(
            tenant, document_id, ErasureRequest(requested_by="cli")
        )
        get_logger(__name__).info(
            "document.erased" if result.changed else "document.erase_repeated",
            tenant_id=tenant,
            document_id=str(document_id),
            by="cli",
        )
        return {
            "documentId": str(result.document_id),
            "deletedAt": result.deleted_at.isoformat(),
            "requestedAt": result.requested_at.isoformat(),
            "erasedAt": result.erased_at.isoformat(),
            "searchToken": result.search_token,
        }

    _print_answer(_erase)
