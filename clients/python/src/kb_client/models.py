"""The API's request and response bodies, as the server's OpenAPI document names them.

Hand-written (readable, documented) and held equal to the server's document by
``tests/client/test_models_match_openapi.py``: field names, which are required, and each
field's type. Unknown fields in answers are ignored, so a server that adds one does not break
an older client; the test is what catches the drift in this repository.
"""

from __future__ import annotations

import enum
import uuid
from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel


class ApiModel(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="ignore", frozen=True
    )


class IndexStatus(enum.StrEnum):
    NOT_PUBLISHED = "NOT_PUBLISHED"
    INDEXING = "INDEXING"
    SEARCHABLE = "SEARCHABLE"
    FAILED = "FAILED"
    DELETED = "DELETED"


class TaskStatus(enum.StrEnum):
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    RETRY_WAIT = "RETRY_WAIT"
    SUCCEEDED = "SUCCEEDED"
    DEAD = "DEAD"


class SearchMode(enum.StrEnum):
    HYBRID = "hybrid"
    VECTOR = "vector"
    KEYWORD = "keyword"


class Degraded(enum.StrEnum):
    KEYWORD_ONLY = "keyword-only"


# --- requests -------------------------------------------------------------------------------


class ReadAcl(ApiModel):
    read: list[str]


class PublishRequest(ApiModel):
    revision: int
    acl: ReadAcl


class SearchFilterBody(ApiModel):
    document_ids: list[uuid.UUID] | None = None
    heading_prefix: list[str] | None = None


class SearchBody(ApiModel):
    query: str
    top_k: int = 10
    principals: list[str] | None = None
    # A principal token is a credential: left out of the repr.
    principal_token: str | None = Field(default=None, repr=False)
    mode: SearchMode = SearchMode.HYBRID
    filter: SearchFilterBody | None = None
    after: list[str] | None = None


# --- answers ----------------------------------------------------------------------------------


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
    deleted_at: datetime | None = None
    # When its content was erased (index_status stays DELETED); None: not, or in progress.
    erased_at: datetime | None = None
    search_lag_since: datetime | None
    search_token: str | None = None


class IngestKeyRequest(ApiModel):
    key_id: str
    public_key: str


class IngestKeyResponse(ApiModel):
    key_id: str
    created_at: datetime | None = None
    revoked_at: datetime | None = None


class IngestKeyListed(ApiModel):
    key_id: str
    public_key: str
    created_at: datetime
    revoked_at: datetime | None = None


class IngestKeyList(ApiModel):
    keys: list[IngestKeyListed]


class DeleteResponse(ApiModel):
    document_id: uuid.UUID
    revision: int
    deleted_at: datetime
    # Past the delete's commit: a search passing it never returns the document.
    search_token: str


class EraseResponse(ApiModel):
    document_id: uuid.UUID
    deleted_at: datetime
    requested_at: datetime
    erased_at: datetime
    # Past the erase's commits: a search passing it never returns the document.
    search_token: str


class IndexTaskResponse(ApiModel):
    task_id: uuid.UUID
    document_id: uuid.UUID
    version_number: int
    task_type: str
    tier: str
    status: TaskStatus
    attempts: int
    max_attempts: int
    lease_until: datetime | None
    next_attempt_at: datetime
    error_code: str | None
    error_message: str | None
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None


class BulkItemResult(ApiModel):
    index: int
    status: int
    document_id: uuid.UUID | None = None
    version_number: int | None = None
    revision: int | None = None
    index_task_id: uuid.UUID | None = None
    deleted_at: datetime | None = None
    requested_at: datetime | None = None
    erased_at: datetime | None = None
    error_code: str | None = None
    detail: str | None = None


class BulkResponse(ApiModel):
    published: int
    deleted: int = 0
    erased: int = 0
    refused: int
    results: list[BulkItemResult]


class SearchHitBody(ApiModel):
    document_id: uuid.UUID
    title: str
    version_number: int
    chunk_id: str
    heading_path: list[str]
    text: str
    score: float
    media_type: str


class GenerationBody(ApiModel):
    embedding_model: str
    dimension: int
    generation_id: int | None


class SearchResponse(ApiModel):
    results: list[SearchHitBody]
    generation: GenerationBody
    took_ms: float
    degraded: Degraded | None = None


class FieldError(BaseModel):
    model_config = ConfigDict(frozen=True)

    loc: list[str | int]
    msg: str
    type: str


class Problem(ApiModel):
    type: str
    title: str
    status: int
    detail: str
    error_code: str
    errors: list[FieldError] | None = None


# Each model and the name of its schema in the server's OpenAPI document.
SCHEMAS: dict[str, type[BaseModel]] = {
    model.__name__: model
    for model in (
        ReadAcl,
        PublishRequest,
        SearchFilterBody,
        SearchBody,
        VersionCreatedResponse,
        PublishResponse,
        FailureResponse,
        DocumentStatusResponse,
        DeleteResponse,
        EraseResponse,
        IngestKeyRequest,
        IngestKeyResponse,
        IngestKeyListed,
        IngestKeyList,
        IndexTaskResponse,
        BulkItemResult,
        BulkResponse,
        SearchHitBody,
        GenerationBody,
        SearchResponse,
        FieldError,
        Problem,
    )
}
ENUMS: dict[str, type[enum.StrEnum]] = {
    e.__name__: e for e in (IndexStatus, TaskStatus, SearchMode, Degraded)
}
