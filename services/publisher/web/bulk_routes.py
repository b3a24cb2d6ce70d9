"""``POST /v1/tenants/{tenantId}/documents/bulk``: many documents or versions published in
one multipart request.

The request: an ``items`` part (JSON: a list of ``{"title", "acl"}`` for a new document,
``{"documentId", "acl"}`` for a new version of one, ``{"documentId", "delete": true,
"revision"}`` for a delete, or ``{"documentId", "erase": true}`` for an erase) and, in the
same order, one ``file`` part per item that is not a delete or an erase, whose content type
is the version's media type. The whole body is bounded by the upload limit and counts
against the upload budget like any upload.

The answer is 200 with one result per item, in order: its document, version, revision and
index task, or its problem (``status``, ``errorCode``, ``detail``: what the single calls
would have answered). The request needs the ``publish`` scope; an erase item also needs
``admin``, checked per item as every other rule is: with another key each erase item is
refused alone (403 ``KEY_SCOPE_INSUFFICIENT``, nothing of it written) and the others go on.
A request that cannot be read at all (no ``items``, malformed or too deeply nested JSON, a
text part not in UTF-8, a file part without a filename, more files than items, too many
items) is refused whole with 400/422 and changes nothing.
"""

from __future__ import annotations

import uuid
from dataclasses import asdict
from datetime import datetime
from typing import Annotated, Any, Final

from fastapi import APIRouter, Depends, Path, Request, Security
from pydantic import Field, ValidationError
from starlette.datastructures import UploadFile

from services.publisher.bulk.domain import (
    BulkItem,
    BulkPublisher,
    ItemDeleted,
    ItemErased,
    ItemPublished,
    ItemRefused,
    ItemResult,
)
from services.publisher.bulk.form import read_form
from services.publisher.domain import MAX_TITLE_LENGTH, Upload
from services.publisher.metrics import PublisherMetrics
from services.publisher.ports import ErasureRequest
from services.publisher.web.links import AFTER_BULK
from services.publisher.web.wire import MAX_INT64, ReadAcl
from services.runtime.auth.keys import Scope
from services.runtime.errors import BadInput, DependencyUnavailable, KbError
from services.runtime.fair_share.middleware import LIMITED_RESPONSE
from services.runtime.logging import get_logger
from services.runtime.tenancy.tenant_auth import KeyScopeInsufficient, require_scope
from services.runtime.tenancy.tenant_ids import TENANT_ID_PATTERN
from services.runtime.web.http_problem import PROBLEM_RESPONSE
from services.runtime.web.http_strict import strict_json_loads
from services.runtime.web.wire import ApiModel

log = get_logger(__name__)

# Starlette's own default bound on the parts of one multipart body.
MAX_BULK_ITEMS: Final = 1000

TenantId = Annotated[str, Path(alias="tenantId", pattern=TENANT_ID_PATTERN)]


class BulkItemRequest(ApiModel):
    title: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_TITLE_LENGTH,
        description="A new document's title (leave out with documentId).",
    )
    document_id: uuid.UUID | None = Field(
        default=None,
        description="Publish the file as a new version of this document (or delete it).",
    )
    acl: ReadAcl | None = Field(default=None, description="Required unless `delete`.")
    delete: bool = Field(
        default=False,
        description="Delete `documentId` as DELETE /documents/{documentId} does; no file part.",
    )
    erase: bool = Field(
        default=False,
        description="Erase `documentId` as POST /documents/{documentId}/erase does (an admin "
        "key only); no file part, no revision.",
    )
    revision: int | None = Field(
        default=None,
        ge=1,
        le=MAX_INT64,
        strict=True,
        description="With `delete`: the document revision you last read.",
    )


class BulkItemResult(ApiModel):
    index: int
    status: int = Field(
        description="202 when published, 200 when deleted or erased, else the item's problem "
        "status."
    )
    document_id: uuid.UUID | None = None
    version_number: int | None = None
    revision: int | None = None
    index_task_id: uuid.UUID | None = None
    deleted_at: datetime | None = None
    requested_at: datetime | None = Field(
        default=None, description="An erase: when its erase was first asked for."
    )
    erased_at: datetime | None = Field(
        default=None, description="An erase: when its content was gone."
    )
    error_code: str | None = None
    detail: str | None = None


class BulkResponse(ApiModel):
    published: int
    deleted: int = 0
    erased: int = 0
    refused: int
    results: list[BulkItemResult]


def _authenticated(request: Request, tenant_id: TenantId) -> None:
    require_scope(request, tenant_id, Scope.PUBLISH)


def bulk_router(security: Any) -> APIRouter:
    """The bulk route behind the tenant routes' authentication (``security``: their bearer
    scheme, so the OpenAPI document names one)."""
    router = APIRouter(
        prefix="/v1/tenants/{tenantId}",
        dependencies=[Security(security), Depends(_authenticated)],
    )
    router.add_api_route(
        "/documents/bulk",
        publish_many,
        methods=["POST"],
        response_model=BulkResponse,
        responses={
            **{s: PROBLEM_RESPONSE for s in (400, 401, 403, 408, 413, 422, 503)},
            429: LIMITED_RESPONSE,  # the tenant's fair share (services/runtime/fair_share)
            200: AFTER_BULK,
        },
        summary="Upload and publish many documents or versions in one request (backfills)",
        openapi_extra=_OPENAPI_BODY,
    )
    return router


async def publish_many(request: Request, tenant_id: TenantId) -> BulkResponse:
    metrics: PublisherMetrics = request.app.state.metrics
    bulk: BulkPublisher | None = request.app.state.bulk_publisher
    if bulk is None:
        raise DependencyUnavailable("bulk publishing is not configured on this app")
    with metrics.counting_errors("bulk_publish"):
        form = await read_form(request, max_files=MAX_BULK_ITEMS, max_fields=MAX_BULK_ITEMS + 1)
    try:
        with metrics.counting_errors("bulk_publish"):
            items = _items(form.getlist("items"), form.getlist("file"))
            eraser = _eraser(request, tenant_id) if any(item.erase for item in items) else None
            results = await bulk.publish_many(tenant_id, items, eraser=eraser)
    finally:
        await form.close()
    answer = [_result(result) for result in results]
    published = sum(1 for result in results if isinstance(result, ItemPublished))
    deleted = sum(1 for result in results if isinstance(result, ItemDeleted))
    erased = sum(1 for result in results if isinstance(result, ItemErased))
    refused = len(results) - published - deleted - erased
    metrics.operations.labels("bulk_publish", "ok").inc()
    for result in results:
        if isinstance(result, ItemRefused):
            metrics.operations.labels("bulk_publish_item", result.error.code).inc()
    log.info(
        "documents.bulk_published",
        tenant_id=tenant_id,
        published=published,
        deleted=deleted,
        erased=erased,
        refused=refused,
    )
    return BulkResponse(
        published=published, deleted=deleted, erased=erased, refused=refused, results=answer
    )


def _eraser(request: Request, tenant_id: str) -> ErasureRequest | KbError:
    """Who asks for the request's erase items, as the single erase records it; or, for a key
    without the admin scope, the error each of them is refused with."""
    try:
        caller = require_scope(request, tenant_id, Scope.ADMIN)
    except KeyScopeInsufficient as refused:
        return refused
    return ErasureRequest(requested_by="api", key_id=caller.grant.key_id)


def _items(manifests: list[Any], files: list[Any]) -> list[BulkItem]:
    """The items with their files, or BadInput naming what makes the request unreadable."""
    if len(manifests) != 1 or not isinstance(manifests[0], str):
        raise BadInput("the request needs exactly one 'items' part (JSON)", code="BULK_INVALID")
    try:
        # Duplicate keys are refused (DUPLICATE_JSON_KEY), as in every JSON body.
        raw = strict_json_loads(manifests[0])
    except ValueError:
        raise BadInput("the 'items' part is not JSON", code="BULK_INVALID") from None
    except RecursionError:
        # json's decoder recurses once per level: a 1,000-deep list exhausts the stack.
        # The manifest is 4 levels deep; a JSON request body gets 400 here too.
        raise BadInput("the 'items' part is nested too deeply", code="BULK_INVALID") from None
    if not isinstance(raw, list) or not raw:
        raise BadInput("'items' must be a non-empty JSON list", code="BULK_INVALID")
    if len(raw) > MAX_BULK_ITEMS:
        raise BadInput(f"at most {MAX_BULK_ITEMS} items per request", code="BULK_INVALID")
    manifests_read = [_manifest(index, entry) for index, entry in enumerate(raw)]
    uploads = [m for m in manifests_read if not (m.delete or m.erase)]
    # read_form refuses a file part without a filename, so every file part is an upload.
    # A delete or erase item takes no file: the files are the other items', in their order.
    if len(files) != len(uploads) or not all(isinstance(f, UploadFile) for f in files):
        raise BadInput(
            f"{len(uploads)} items that are not deletes or erases need {len(uploads)} "
            f"'file' parts, "
            f"in order; got {len(files)}",
            code="BULK_INVALID",
        )
    file_of = iter(files)
    items = []
    for manifest in manifests_read:
        if manifest.delete or manifest.erase:
            items.append(
                BulkItem(
                    upload=None,
                    read_principals=[],
                    document_id=manifest.document_id,
                    delete_revision=manifest.revision,
                    erase=manifest.erase,
                )
            )
            continue
        file = next(file_of)
        assert manifest.acl is not None
        items.append(
            BulkItem(
                upload=Upload(
                    content=file.file.read(),
                    declared_media_type=file.content_type,
                    filename=file.filename,
                ),
                read_principals=list(manifest.acl.read),
                title=manifest.title,
                document_id=manifest.document_id,
            )
        )
    return items


def _manifest(index: int, entry: Any) -> BulkItemRequest:
    """One item's manifest, or BadInput naming what makes it unreadable."""
    try:
        manifest = BulkItemRequest.model_validate(entry)
    except ValidationError as error:
        first = error.errors(include_input=False, include_url=False)[0]
        where = ".".join(str(part) for part in first["loc"])
        raise BadInput(f"item {index}: {where}: {first['msg']}", code="BULK_INVALID") from None
    if manifest.delete or manifest.erase:
        # A delete names its document and the revision last read; an erase, an admin's
        # order, its document only (as the single calls take them).
        what = (
            "an erase names a documentId"
            if manifest.erase
            else "a delete names a documentId and a revision"
        )
        if (
            manifest.document_id is None
            or (manifest.delete and manifest.erase)
            or (manifest.revision is None) == manifest.delete
            or manifest.title is not None
            or manifest.acl is not None
        ):
            raise BadInput(f"item {index}: {what}, and nothing else", code="BULK_INVALID")
        return manifest
    if (manifest.title is None) == (manifest.document_id is None):
        raise BadInput(
            f"item {index}: give a title (a new document) or a documentId (a new version)",
            code="BULK_INVALID",
        )
    if manifest.acl is None or manifest.revision is not None:
        raise BadInput(
            f"item {index}: a publish item needs an acl, and takes no revision",
            code="BULK_INVALID",
        )
    return manifest


# The status of an item that succeeded, by what it did (its fields are the answer's).
_DONE_STATUS: Final[dict[type[ItemResult], int]] = {
    ItemPublished: 202,
    ItemDeleted: 200,
    ItemErased: 200,
}


def _result(result: ItemResult) -> BulkItemResult:
    if not isinstance(result, ItemRefused):
        return BulkItemResult(status=_DONE_STATUS[type(result)], **asdict(result))
    error = result.error
    # A server-side failure of one item is not the client's to read: its code only.
    detail = error.message if error.http_status < 500 else "the item could not be published"
    return BulkItemResult(
        index=result.index, status=error.http_status, error_code=error.code, detail=detail
    )


_OPENAPI_BODY: Final[dict[str, Any]] = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["items"],
                    "properties": {
                        "items": {
                            "type": "string",
                            "description": (
                                "JSON list, one entry per item in order: "
                                '{"title": ..., "acl": {"read": [...]}} for a new document, '
                                '{"documentId": ..., "acl": {"read": [...]}} for a new '
                                'version of one, {"documentId": ..., "delete": true, '
                                '"revision": ...} for a delete, {"documentId": ..., '
                                '"erase": true} for an erase (an admin key only); a delete '
                                "or an erase takes no file part."
                            ),
                        },
                        "file": {
                            "type": "array",
                            "items": {"type": "string", "format": "binary"},
                            "maxItems": MAX_BULK_ITEMS,
                        },
                    },
                },
                "encoding": {"file": {"contentType": "*/*"}},
            }
        },
    }
}
