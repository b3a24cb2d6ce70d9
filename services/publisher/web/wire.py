"""The publisher's wire models: what its JSON requests and answers look like (camelCase).

Answers are built straight from the domain's dataclasses, field by field name.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated, Final

from pydantic import Field, StringConstraints

from services.publisher.domain import MAX_PRINCIPAL_LENGTH, IndexStatus, TenantTaskView
from services.publisher.text import REFUSED_CHARACTERS
from services.runtime.web.wire import ApiModel, wire_model_of

MAX_INT32: Final = 2_147_483_647
MAX_INT64: Final = 9_223_372_036_854_775_807
MAX_PRINCIPALS: Final = 1000


Principal = Annotated[str, StringConstraints(min_length=1, max_length=MAX_PRINCIPAL_LENGTH)]


class ReadAcl(ApiModel):
    read: list[Principal] = Field(
        max_length=MAX_PRINCIPALS,
        description=(
            "Principals allowed to read the published version (replaces the ACL). Compared "
            f"in Unicode NFC; {REFUSED_CHARACTERS}."
        ),
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
    error_code: str = Field(description="Stable; branch on this.")
    message: str | None = Field(description="A fixed text per error code.")
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
    deleted_at: datetime | None = Field(
        default=None,
        description="When the document was deleted (`indexStatus` DELETED); null if it is not.",
    )
    erased_at: datetime | None = Field(
        default=None,
        description="When its content was erased (`indexStatus` stays DELETED); null if it "
        "was not, or its erase is still in progress.",
    )
    search_lag_since: datetime | None = Field(
        description="Since when search serves another version than the published one."
    )
    search_token: str | None = Field(
        default=None,
        description="A WAL position at or past the commit that made `searchVersion` "
        "searchable; null while no version is served. Pass it in a search's `after` to be "
        "answered only by a database (a read replica, or the primary) that serves "
        "`searchVersion` or a later version (docs/scaling.md#read-your-switch).",
    )


class DeleteResponse(ApiModel):
    document_id: uuid.UUID
    revision: int = Field(description="The revision the delete committed.")
    deleted_at: datetime
    search_token: str = Field(
        description="A WAL position past the delete's commit. Pass it in a search's `after`: "
        "no server answering it returns the document (docs/scaling.md#read-your-switch)."
    )


class EraseResponse(ApiModel):
    document_id: uuid.UUID
    deleted_at: datetime = Field(
        description="When the document was deleted (by this erase, if it was live)."
    )
    requested_at: datetime = Field(description="When its erase was first asked for.")
    erased_at: datetime = Field(description="When its content was gone.")
    search_token: str = Field(
        description="A WAL position past the erase's commits. Pass it in a search's `after`: "
        "no server answering it returns the document (docs/scaling.md#read-your-switch)."
    )


# What a tenant sees of its task is the domain's view, field for field.
IndexTaskResponse: Final = wire_model_of(
    TenantTaskView,
    "IndexTaskResponse",
    error_code=Field(description="Stable; branch on this."),
    error_message=Field(description="A fixed text per error code."),
)


class HealthResponse(ApiModel):
    status: str
