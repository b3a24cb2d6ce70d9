"""The publisher's HTTP API (DESIGN §7): FastAPI routes, auth and body-size middleware.

Every ``/v1/tenants/{tenantId}/...`` request is authenticated before routing, validation or
body parsing: without a valid key it is 401, with another tenant's key 403, whatever else is
wrong with it. Every error is ``application/problem+json`` with a stable ``errorCode``.

The search call of DESIGN §7 belongs to the indexing pipeline and is not served here yet.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime
from typing import Annotated, Any, Final

from fastapi import (
    APIRouter,
    Depends,
    FastAPI,
    File,
    Form,
    Path,
    Request,
    Security,
    UploadFile,
)
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPBearer
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field, StringConstraints
from pydantic.alias_generators import to_camel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.publisher.auth import TENANT_ID_PATTERN, bearer_token, parse_api_key
from services.publisher.domain import (
    IndexStatus,
    Publisher,
    Upload,
)
from services.publisher.metrics import MetricsMiddleware, PublisherMetrics
from services.publisher.ports import PublisherStore
from services.publisher.settings import PublisherSettings
from services.runtime.errors import KbError, Unauthenticated
from services.runtime.http_problem import (
    PROBLEM_RESPONSE,
    install_problem_handlers,
    kb_error_response,
    problem_response,
)
from services.runtime.logging import get_logger

log = get_logger(__name__)

MAX_INT32: Final = 2_147_483_647
MAX_INT64: Final = 9_223_372_036_854_775_807
MAX_PRINCIPALS: Final = 1000
AUTHENTICATED_TENANT: Final = "kb.authenticated_tenant"
_TENANT_PATH = re.compile(r"^/v1/tenants/(?P<tenant>[^/]*)(?:/|$)")

# --- wire models ---------------------------------------------------------------------------


class ApiModel(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
        # Answers are built straight from the domain's dataclasses, field by field name.
        from_attributes=True,
    )


Principal = Annotated[str, StringConstraints(min_length=1, max_length=200)]


class ReadAcl(ApiModel):
    read: list[Principal] = Field(
        max_length=MAX_PRINCIPALS,
        description="Principals allowed to read the published version (replaces the ACL).",
    )


class PublishRequest(ApiModel):
    revision: int = Field(
        ge=1, le=MAX_INT64, strict=True, description="The document revision you last read."
    )
    acl: ReadAcl


class VersionCreatedResponse(ApiModel):
    document_id: uuid.UUID
    version_number: int
    revision: int


class PublishResponse(ApiModel):
    document_id: uuid.UUID
    version_number: int
    revision: int
    index_task_id: uuid.UUID


class FailureResponse(ApiModel):
    error_code: str
    message: str | None
    attempts: int
    failed_at: datetime | None


class DocumentStatusResponse(ApiModel):
    document_id: uuid.UUID
    title: str
    revision: int
    latest_version: int
    published_version: int | None
    published_at: datetime | None
    search_version: int | None
    search_switched_at: datetime | None
    index_status: IndexStatus
    index_task_id: uuid.UUID | None
    failure: FailureResponse | None
    search_lag_since: datetime | None = Field(
        description="Since when search serves another version than the published one."
    )


class IndexTaskResponse(ApiModel):
    task_id: uuid.UUID
    document_id: uuid.UUID
    version_number: int
    task_type: str
    tier: str
    status: str
    attempts: int
    max_attempts: int
    lease_owner: str | None
    lease_until: datetime | None
    next_attempt_at: datetime
    error_code: str | None
    error_message: str | None
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None


class HealthResponse(ApiModel):
    status: str


# --- middleware ----------------------------------------------------------------------------


class TenantAuthMiddleware:
    """Authenticate every ``/v1/tenants/{t}/...`` request before anything else looks at it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        match = _TENANT_PATH.match(_route_path(scope)) if scope["type"] == "http" else None
        if match is None:
            await self.app(scope, receive, send)
            return
        path_tenant = match["tenant"]  # ASGI paths arrive percent-decoded
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        presented = None
        token = bearer_token(headers.get("authorization"))
        if token is not None:
            presented = parse_api_key(token)
        store: PublisherStore = scope["app"].state.store
        try:
            valid = presented is not None and await store.api_key_is_valid(
                presented.tenant_id, presented.key_hash
            )
        except KbError as error:
            await kb_error_response(error, scope["path"])(scope, receive, send)
            return
        if presented is None or not valid:
            response = problem_response(
                401,
                "UNAUTHENTICATED",
                "send a valid tenant API key: Authorization: Bearer <key>",
                instance=scope["path"],
                headers={"WWW-Authenticate": "Bearer"},
            )
        elif presented.tenant_id != path_tenant:
            response = problem_response(
                403,
                "FORBIDDEN",
                "this API key belongs to another tenant",
                instance=scope["path"],
            )
        else:
            # Routes check this again (`_require_authenticated_tenant`): should a request ever
            # reach them without passing here, it is refused, not served.
            scope.setdefault("state", {})[AUTHENTICATED_TENANT] = presented.tenant_id
            await self.app(scope, receive, send)
            return
        await response(scope, receive, send)


def _route_path(scope: Scope) -> str:
    """The path the router matches: behind a proxy prefix (``root_path``) the ASGI path
    still carries the prefix, and the router strips it before matching."""
    path: str = scope["path"]
    root_path: str = scope.get("root_path", "")
    if root_path and path.startswith(root_path):
        return path[len(root_path) :] or "/"
    return path


class BodyLimitMiddleware:
    """Refuse bodies above the limit without reading them into memory (413)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name.lower() == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1
                if declared < 0:
                    await problem_response(
                        400, "BAD_REQUEST", "invalid Content-Length", instance=scope["path"]
                    )(scope, receive, send)
                    return
                if declared > self.max_bytes:
                    await self._too_large(scope, receive, send)
                    return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # FastAPI re-raises an HTTPException met while reading the body; the
                    # problem handler turns it into the 413 answer.
                    raise StarletteHTTPException(413, self._detail())
            return message

        await self.app(scope, limited_receive, send)

    def _detail(self) -> str:
        return f"the request body is larger than {self.max_bytes} bytes"

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        await problem_response(413, "PAYLOAD_TOO_LARGE", self._detail(), instance=scope["path"])(
            scope, receive, send
        )


# --- routes --------------------------------------------------------------------------------

bearer = HTTPBearer(
    auto_error=False,
    scheme_name="TenantApiKey",
    description="The tenant's API key from `kb tenants create` (`kb.<tenant>.<secret>`).",
)

TenantId = Annotated[str, Path(alias="tenantId", pattern=TENANT_ID_PATTERN)]
DocumentId = Annotated[uuid.UUID, Path(alias="documentId")]
VersionNumber = Annotated[int, Path(alias="versionNumber", ge=1, le=MAX_INT32)]
TaskId = Annotated[uuid.UUID, Path(alias="taskId")]


def _problems(*statuses: int) -> dict[int | str, dict[str, Any]]:
    # Any tenant call can meet these: authentication, the body limit, request validation.
    return {status: PROBLEM_RESPONSE for status in sorted({400, 401, 403, 413, 422, *statuses})}


def _publisher(request: Request) -> Publisher:
    publisher: Publisher = request.app.state.publisher
    return publisher


def _metrics(request: Request) -> PublisherMetrics:
    metrics: PublisherMetrics = request.app.state.metrics
    return metrics


async def _read_upload(file: UploadFile) -> Upload:
    content = await file.read()
    return Upload(content=content, declared_media_type=file.content_type, filename=file.filename)


@asynccontextmanager
async def _counted(request: Request, operation: str) -> AsyncIterator[None]:
    metrics = _metrics(request)
    try:
        yield
    except KbError as error:
        metrics.operations.labels(operation, error.code).inc()
        raise
    metrics.operations.labels(operation, "ok").inc()


def _require_authenticated_tenant(request: Request, tenant_id: TenantId) -> None:
    """Fail closed: serve a tenant path only to a request the middleware authenticated for
    exactly that tenant."""
    if request.scope.get("state", {}).get(AUTHENTICATED_TENANT) != tenant_id:
        raise Unauthenticated("send a valid tenant API key: Authorization: Bearer <key>")


tenant_router = APIRouter(
    prefix="/v1/tenants/{tenantId}",
    dependencies=[Security(bearer), Depends(_require_authenticated_tenant)],
)


@tenant_router.post(
    "/documents",
    status_code=201,
    response_model=VersionCreatedResponse,
    responses=_problems(400, 413, 415),
    summary="Upload a new document (its version 1, as a draft)",
)
async def create_document(
    request: Request,
    tenant_id: TenantId,
    file: Annotated[UploadFile, File(description="The document's content.")],
    title: Annotated[str, Form(min_length=1, max_length=500)],
) -> VersionCreatedResponse:
    async with _counted(request, "create_document"):
        upload = await _read_upload(file)
        result = await _publisher(request).create_document(tenant_id, title, upload)
    _metrics(request).upload_bytes.observe(len(upload.content))
    log.info(
        "document.created",
        tenant_id=tenant_id,
        document_id=str(result.document_id),
        size_bytes=len(upload.content),
    )
    return VersionCreatedResponse.model_validate(result)


@tenant_router.post(
    "/documents/{documentId}/versions",
    status_code=201,
    response_model=VersionCreatedResponse,
    responses=_problems(400, 404, 413, 415),
    summary="Upload a new version of a document (as a draft)",
)
async def add_version(
    request: Request,
    tenant_id: TenantId,
    document_id: DocumentId,
    file: Annotated[UploadFile, File(description="The version's content.")],
) -> VersionCreatedResponse:
    async with _counted(request, "add_version"):
        upload = await _read_upload(file)
        result = await _publisher(request).add_version(tenant_id, document_id, upload)
    _metrics(request).upload_bytes.observe(len(upload.content))
    log.info(
        "version.created",
        tenant_id=tenant_id,
        document_id=str(document_id),
        version_number=result.version_number,
    )
    return VersionCreatedResponse.model_validate(result)


@tenant_router.post(
    "/documents/{documentId}/versions/{versionNumber}/publish",
    status_code=202,
    response_model=PublishResponse,
    responses=_problems(400, 404, 409),
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
    try:
        result = await _publisher(request).publish(
            tenant_id,
            document_id,
            version_number,
            expected_revision=body.revision,
            read_principals=list(body.acl.read),
        )
    except KbError as error:
        metrics.operations.labels("publish", error.code).inc()
        raise
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
    responses=_problems(404),
    summary="Where a document stands: published, indexing, searchable or failed",
)
async def document_status(
    request: Request, tenant_id: TenantId, document_id: DocumentId
) -> DocumentStatusResponse:
    return DocumentStatusResponse.model_validate(
        await _publisher(request).document_status(tenant_id, document_id)
    )


@tenant_router.get(
    "/index-tasks/{taskId}",
    response_model=IndexTaskResponse,
    responses=_problems(404),
    summary="An index task",
)
async def index_task(request: Request, tenant_id: TenantId, task_id: TaskId) -> IndexTaskResponse:
    return IndexTaskResponse.model_validate(
        await _publisher(request).index_task(tenant_id, task_id)
    )


ops_router = APIRouter()


@ops_router.get("/healthz", response_model=HealthResponse, summary="Liveness")
async def healthz() -> HealthResponse:
    return HealthResponse(status="ok")


@ops_router.get(
    "/readyz",
    response_model=HealthResponse,
    responses={503: PROBLEM_RESPONSE},
    summary="Readiness: the database answers and every migration is applied",
)
async def readyz(request: Request) -> HealthResponse | JSONResponse:
    problems = await _publisher(request).readiness_problems()
    if problems:
        return problem_response(503, "NOT_READY", "; ".join(problems), instance=request.url.path)
    return HealthResponse(status="ready")


@ops_router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}}},
    summary="Prometheus metrics",
)
async def metrics(request: Request) -> Response:
    return Response(generate_latest(_metrics(request).registry), media_type=CONTENT_TYPE_LATEST)


# --- the app -------------------------------------------------------------------------------


def _problems_only_as_problem_json(app: FastAPI) -> None:
    """Error answers are documented as application/problem+json only (FastAPI would also
    list the route's default application/json for them)."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = generate()
        for path_item in schema.get("paths", {}).values():
            for operation in path_item.values():
                for status, response in operation.get("responses", {}).items():
                    content = response.get("content", {})
                    if status[:1] in {"4", "5"} and "application/problem+json" in content:
                        content.pop("application/json", None)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def create_app(
    settings: PublisherSettings | None = None, *, store: PublisherStore | None = None
) -> FastAPI:
    """The publisher app. Without ``store`` it opens its own pool in its lifespan."""
    settings = settings or PublisherSettings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if app.state.store is not None:
            yield
            return
        from services.publisher.store_pg import PgPublisherStore
        from services.runtime.db import create_pool

        pool = await create_pool(settings)
        app.state.store = PgPublisherStore(pool, acquire_timeout_s=settings.db_acquire_timeout_s)
        app.state.publisher = Publisher(app.state.store, max_upload_bytes=settings.max_upload_bytes)
        log.info("publisher.started")
        try:
            yield
        finally:
            await pool.close()
            log.info("publisher.stopped")

    app = FastAPI(
        title="kb-pipeline publisher",
        version="1",
        description=(
            "Upload immutable document versions, publish them with a read ACL (indexing "
            "happens later, in the indexer), and see where each document stands. Errors are "
            "application/problem+json with a stable errorCode."
        ),
        lifespan=lifespan,
        generate_unique_id_function=lambda route: route.name,
    )
    _problems_only_as_problem_json(app)
    app.state.settings = settings
    app.state.store = store
    app.state.publisher = (
        Publisher(store, max_upload_bytes=settings.max_upload_bytes) if store else None
    )
    app.state.metrics = PublisherMetrics()
    install_problem_handlers(app)
    app.include_router(tenant_router)
    app.include_router(ops_router)
    # Added innermost first: metrics see every answer, auth runs before the body is read.
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_request_bytes)
    app.add_middleware(TenantAuthMiddleware)
    app.add_middleware(MetricsMiddleware, metrics=app.state.metrics)
    return app
