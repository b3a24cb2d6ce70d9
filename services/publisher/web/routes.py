"""The publisher's tenant routes (docs/architecture.md#the-http-contract): upload, publish, document
status, index task.

Every route sits behind tenant authentication (services.runtime.tenancy.tenant_auth): the
middleware checks the key, the router's dependency refuses whatever did not pass it and
keys without the ``publish`` scope (status reads too: they show titles, whatever the ACL).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Annotated, Any, Final

from fastapi import APIRouter, Depends, File, Form, Path, Query, Request, Security, UploadFile
from fastapi.security import HTTPBearer

from services.publisher.domain import MAX_TITLE_LENGTH, Publisher, Upload, VersionCreated
from services.publisher.metrics import PublisherMetrics
from services.publisher.ports import ErasureRequest
from services.publisher.strict_form import StrictFormRoute
from services.publisher.text import REFUSED_CHARACTERS
from services.publisher.web.links import (
    AFTER_DELETE,
    AFTER_ERASE,
    AFTER_INDEX_TASK,
    AFTER_PUBLISH,
    AFTER_STATUS,
    AFTER_UPLOAD,
)
from services.publisher.web.wire import (
    MAX_INT32,
    MAX_INT64,
    DeleteResponse,
    DocumentStatusResponse,
    EraseResponse,
    IndexTaskResponse,
    PublishRequest,
    PublishResponse,
    VersionCreatedResponse,
)
from services.runtime.auth.keys import Scope
from services.runtime.fair_share.middleware import LIMITED_RESPONSE
from services.runtime.logging import get_logger
from services.runtime.tenancy.tenant_auth import require_scope
from services.runtime.tenancy.tenant_ids import TENANT_ID_PATTERN
from services.runtime.web.http_problem import PROBLEM_RESPONSE
from services.runtime.web.wire import ApiModel

log = get_logger(__name__)

bearer = HTTPBearer(
    auto_error=False,
    scheme_name="TenantApiKey",
    description="A tenant API key (`kb.<tenant>.<secret>`) from `kb tenants create` or "
    "`kb tenants keys create`; these calls need the `publish` (or `admin`) scope.",
)

TenantId = Annotated[str, Path(alias="tenantId", pattern=TENANT_ID_PATTERN)]
DocumentId = Annotated[uuid.UUID, Path(alias="documentId")]
VersionNumber = Annotated[int, Path(alias="versionNumber", ge=1, le=MAX_INT32)]
TaskId = Annotated[uuid.UUID, Path(alias="taskId")]


def _problems(*statuses: int) -> dict[int | str, dict[str, Any]]:
    # Any tenant call can meet these: authentication, the body limits, request validation,
    # a stalled body, a busy service.
    common = {400, 401, 403, 408, 413, 422, 429, 503}
    return {status: PROBLEM_RESPONSE for status in sorted({*common, *statuses})}


# An upload's 415 has two causes a client handles differently: a type that is never indexed
# (send another format) and bytes that are not what the type says (fix the file or the type).
_UPLOAD_415: Final[dict[str, Any]] = {
    **PROBLEM_RESPONSE,
    "description": (
        "`UNSUPPORTED_MEDIA_TYPE`: the declared type (or, for an unspecific one, the file "
        "name's extension) is not one that is indexed. `MEDIA_TYPE_MISMATCH`: the bytes are "
        "not what the type says: a PDF must start with `%PDF-` (after whitespace at most), a "
        "DOCX must be a zip holding `[Content_Types].xml` and `word/document.xml`, text must "
        "decode strictly as UTF-8 or by its byte-order mark (UTF-8/16/32); HTML may name a "
        "WHATWG Encoding Standard label in `<meta charset>` instead (never UTF-7 or a codec "
        "that transforms bytes). Text must not be binary: no NUL, at most 1 in 100 "
        "characters a control character, not a PDF or zip."
    ),
}


def _upload_problems(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {**_limited_problems(*statuses), 415: _UPLOAD_415}


def _limited_problems(*statuses: int) -> dict[int | str, dict[str, Any]]:
    # A publishing call takes the tenant's fair share (services/runtime/fair_share): 429.
    return {**_problems(*statuses), 429: LIMITED_RESPONSE}


def _authenticated(request: Request, tenant_id: TenantId) -> None:
    require_scope(request, tenant_id, Scope.PUBLISH)


# The uploads' multipart bodies are read strictly (services/publisher/strict_form.py): a
# text part not in UTF-8 or a file part without a filename is 400 BAD_REQUEST, like any
# multipart the parser cannot read.
tenant_router = APIRouter(
    prefix="/v1/tenants/{tenantId}",
    dependencies=[Security(bearer), Depends(_authenticated)],
    route_class=StrictFormRoute,
)


def _publisher(request: Request) -> Publisher:
    publisher: Publisher = request.app.state.publisher
    return publisher


def _metrics(request: Request) -> PublisherMetrics:
    metrics: PublisherMetrics = request.app.state.metrics
    return metrics


async def _read_upload(file: UploadFile) -> Upload:
    content = await file.read()
    return Upload(content=content, declared_media_type=file.content_type, filename=file.filename)


async def _store_upload(
    request: Request,
    tenant_id: str,
    file: UploadFile,
    store: Callable[[Upload], Awaitable[VersionCreated]],
    operation: str,
    event: str,
) -> VersionCreatedResponse:
    """Read the upload and ``store`` it as a new version, counted as ``operation`` and
    logged as ``event``."""
    async with _counted(request, operation):
        upload = await _read_upload(file)
        created = await store(upload)
    _metrics(request).upload_bytes.observe(len(upload.content))
    log.info(
        event,
        tenant_id=tenant_id,
        document_id=str(created.document_id),
        version_number=created.version_number,
        size_bytes=len(upload.content),
    )
    return VersionCreatedResponse.model_validate(created)


@asynccontextmanager
async def _counted(request: Request, operation: str) -> AsyncIterator[None]:
    metrics = _metrics(request)
    with metrics.counting_errors(operation):
        yield
    metrics.operations.labels(operation, "ok").inc()


@tenant_router.post(
    "/documents",
    status_code=201,
    response_model=VersionCreatedResponse,
    responses={**_upload_problems(), 201: AFTER_UPLOAD},
    summary="Upload a new document (its version 1, as a draft)",
)
async def create_document(
    request: Request,
    tenant_id: TenantId,
    file: Annotated[UploadFile, File(description="The document's content.")],
    title: Annotated[
        str,
        Form(
            min_length=1,
            max_length=MAX_TITLE_LENGTH,
            description=(
                f"Stored in Unicode NFC, trimmed; {REFUSED_CHARACTERS} (`TITLE_INVALID`)."
            ),
        ),
    ],
) -> VersionCreatedResponse:
    store = partial(_publisher(request).create_document, tenant_id, title)
    return await _store_upload(
        request, tenant_id, file, store, "create_document", "document.created"
    )


@tenant_router.post(
    "/documents/{documentId}/versions",
    status_code=201,
    response_model=VersionCreatedResponse,
    responses={**_upload_problems(404, 409), 201: AFTER_UPLOAD},
    summary="Upload a new version of a document (as a draft)",
)
async def add_version(
    request: Request,
    tenant_id: TenantId,
    document_id: DocumentId,
    file: Annotated[UploadFile, File(description="The version's content.")],
) -> VersionCreatedResponse:
    store = partial(_publisher(request).add_version, tenant_id, document_id)
    return await _store_upload(request, tenant_id, file, store, "add_version", "version.created")


@tenant_router.post(
    "/documents/{documentId}/versions/{versionNumber}/publish",
    status_code=202,
    response_model=PublishResponse,
    responses={**_limited_problems(404, 409), 202: AFTER_PUBLISH},
    summary="Publish a version with its read ACL; indexing happens later",
)
async def publish_version(
    request: Request,
    tenant_id: TenantId,
    document_id: DocumentId,
    version_number: VersionNumber,
    body: PublishRequest,
) -> PublishResponse:
    metrics = _metrics(request)
    with metrics.counting_errors("publish"):
        result = await _publisher(request).publish(
            tenant_id,
            document_id,
            version_number,
            expected_revision=body.revision,
            read_principals=list(body.acl.read),
        )
    metrics.operations.labels("publish", "ok" if result.changed else "unchanged").inc()
    log.info(
        "version.published" if result.changed else "version.publish_repeated",
        tenant_id=tenant_id,
        document_id=str(document_id),
        version_number=version_number,
        revision=result.revision,
        task_id=str(result.index_task_id),
    )
    return PublishResponse.model_validate(result)


@tenant_router.get(
    "/documents/{documentId}",
    response_model=DocumentStatusResponse,
    responses={**_problems(404), 200: AFTER_STATUS},
    summary="Where a document stands: published, indexing, searchable or failed",
)
async def document_status(
    request: Request, tenant_id: TenantId, document_id: DocumentId
) -> DocumentStatusResponse:
    status = await _publisher(request).document_status(tenant_id, document_id)
    _metrics(request).status_reads.labels(status.read_from).inc()
    return DocumentStatusResponse.model_validate(status)


@tenant_router.delete(
    "/documents/{documentId}",
    response_model=DeleteResponse,
    responses={**_problems(404, 409), 200: AFTER_DELETE},
    summary="Delete a document: it leaves search at once, for good",
    description=(
        "In one transaction the document leaves search (on every server that has replayed "
        "the answer's `searchToken`), its ACL stops applying, its unfinished index tasks end "
        "(`DOCUMENT_DELETED`) and a `DocumentDeleted` event is written. Deleting a deleted "
        "document answers 200 with what its delete did, whatever the revision. A deleted "
        "document takes no new version or publish (409 `DOCUMENT_DELETED`). A stale "
        "revision: 409 `REVISION_CONFLICT` with `currentRevision`."
    ),
)
async def delete_document(
    request: Request,
    tenant_id: TenantId,
    document_id: DocumentId,
    # A query parameter, not a body: a DELETE's body has no defined meaning (RFC 9110,
    # 9.3.5) and some clients and proxies drop it. The name and meaning are publish's.
    revision: Annotated[
        int,
        Query(ge=1, le=MAX_INT64, description="The document revision you last read."),
    ],
) -> DeleteResponse:
    metrics = _metrics(request)
    with metrics.counting_errors("delete_document"):
        result = await _publisher(request).delete_document(
            tenant_id, document_id, expected_revision=revision
        )
    metrics.operations.labels("delete_document", "ok" if result.changed else "unchanged").inc()
    log.info(
        "document.deleted" if result.changed else "document.delete_repeated",
        tenant_id=tenant_id,
        document_id=str(document_id),
        revision=result.revision,
    )
    return DeleteResponse.model_validate(result)


@tenant_router.post(
    "/documents/{documentId}/erase",
    response_model=EraseResponse,
    responses={**_problems(404), 200: AFTER_ERASE},
    summary="Erase a document's content for good (an admin key only)",
    description=(
        "Erase implies delete: a live document is first deleted (as by DELETE, whatever its "
        "revision), then everything the system holds of its content goes: every version's "
        "bytes, every chunk and embedding in every generation, staged slices, the versions' "
        "ACLs, the index tasks' error texts, the titles and principals of its outbox events. "
        "What remains: an audit row (tenant, document, when, which key), the tombstone and "
        "ids. Large documents are erased in bounded batches, each a short transaction. "
        "Idempotent: erasing an erased document answers what its erase did; an erase that "
        "stopped halfway is finished. Needs the `admin` scope (403 `KEY_SCOPE_INSUFFICIENT`)."
    ),
)
async def erase_document(
    request: Request, tenant_id: TenantId, document_id: DocumentId
) -> EraseResponse:
    caller = require_scope(request, tenant_id, Scope.ADMIN)
    metrics = _metrics(request)
    with metrics.counting_errors("erase_document"):
        result = await _publisher(request).erase_document(
            tenant_id,
            document_id,
            ErasureRequest(requested_by="api", key_id=caller.grant.key_id),
        )
    metrics.operations.labels("erase_document", "ok" if result.changed else "unchanged").inc()
    log.info(
        "document.erased" if result.changed else "document.erase_repeated",
        tenant_id=tenant_id,
        document_id=str(document_id),
        key_id=str(caller.grant.key_id),
    )
    return EraseResponse.model_validate(result)


@tenant_router.get(
    "/index-tasks/{taskId}",
    response_model=IndexTaskResponse,
    responses={**_problems(404), 200: AFTER_INDEX_TASK},
    summary="An index task: its state, and a stable code with a fixed message if it failed",
)
async def index_task(request: Request, tenant_id: TenantId, task_id: TaskId) -> ApiModel:
    return IndexTaskResponse.model_validate(
        await _publisher(request).index_task(tenant_id, task_id)
    )
