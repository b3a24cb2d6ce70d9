"""What the sync and async clients share: requests as data, answers to models or errors, the
retry schedule, the search-token memory and the meaning of a status while waiting."""

from __future__ import annotations

import enum
import json
import mimetypes
import random
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel, ValidationError

from kb_client.errors import (
    DocumentDeleted,
    IndexingFailed,
    KbClientError,
    ProblemError,
    TransportError,
    VersionSuperseded,
    problem_class,
)
from kb_client.models import DocumentStatusResponse, FieldError, IndexStatus

M = TypeVar("M", bound=BaseModel)

# What a file to upload may be: its bytes (named by ``filename``), or a path to read.
FileInput = bytes | str | Path


class ApiKey:
    """A tenant API key (``kb.<tenant>.<secret>``): its repr shows the tenant only."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    @property
    def tenant(self) -> str | None:
        parts = self._value.split(".")
        return parts[1] if len(parts) == 3 and parts[0] == "kb" else None

    def secret(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return f"ApiKey(tenant={self.tenant!r}, secret=***)"

    __str__ = __repr__


class Retry(enum.Enum):
    """Which failures a call may be sent again after."""

    # Reads, searches, publish, delete and erase (the server answers a repeated publish of
    # the same version with the same ACL with the same task, a repeated delete with what the
    # first did, whatever its revision, and a repeated erase with what it did, finishing one
    # that stopped halfway; none changes anything more).
    SAFE = "safe"
    # Uploads: a second send may create a second version; only a 429 (refused before any
    # work) is retried.
    REFUSED_ONLY = "refused-only"


@dataclass(frozen=True)
class RetryPolicy:
    """Full-jitter exponential backoff, never shorter than the server's Retry-After, and
    never past ``deadline_seconds`` from the call's start."""

    max_attempts: int = 5
    base_delay: float = 0.2
    max_delay: float = 10.0
    deadline_seconds: float = 30.0

    def delay(self, attempt: int, retry_after: float | None) -> float:
        backoff = random.uniform(0, min(self.max_delay, self.base_delay * 2**attempt))
        if retry_after is None:
            return backoff
        # Jitter after the server's time too: clients told the same Retry-After would
        # otherwise all come back in the same instant.
        return max(backoff, retry_after + random.uniform(0, self.base_delay))


NO_RETRIES = RetryPolicy(max_attempts=1)
RETRIED_STATUSES = frozenset({429, 503})


@dataclass(frozen=True)
class Call:
    method: str
    path: str
    retry: Retry
    json: Any = None
    params: Mapping[str, str] | None = None
    data: Mapping[str, str] | None = None
    files: Sequence[tuple[str, tuple[str, bytes, str]]] | None = None


def retriable(call: Call, error: KbClientError | httpx.TransportError) -> bool:
    if isinstance(error, ProblemError):
        if call.retry is Retry.REFUSED_ONLY:
            return error.status == 429
        return error.status in RETRIED_STATUSES
    return isinstance(error, httpx.TransportError) and call.retry is Retry.SAFE


def parse(response: httpx.Response, model: type[M]) -> M:
    if response.is_success:
        return model.model_validate_json(response.content)
    raise problem(response)


def problem(response: httpx.Response) -> ProblemError:
    try:
        body = response.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        body = None
    if not isinstance(body, dict):
        body = {}
    code = str(body.get("errorCode") or f"HTTP_{response.status_code}")
    known = {"type", "title", "status", "detail", "errorCode", "errors"}
    try:
        errors = [FieldError.model_validate(e) for e in body.get("errors") or []]
    except ValidationError:
        errors = []
    return problem_class(response.status_code, code)(
        status=response.status_code,
        code=code,
        detail=str(body.get("detail") or response.reason_phrase),
        title=str(body.get("title") or ""),
        retry_after=retry_after(response.headers.get("retry-after")),
        errors=errors,
        extra={k: v for k, v in body.items() if k not in known},
    )


def retry_after(value: str | None) -> float | None:
    # The server sends seconds; an HTTP date (which it never sends) is treated as absent.
    try:
        seconds = float(value) if value is not None else None
    except ValueError:
        return None
    return max(0.0, seconds) if seconds is not None else None


def tenant_path(tenant: str, rest: str) -> str:
    return f"/v1/tenants/{quote(tenant, safe='')}{rest}"


def file_part(
    file: FileInput, filename: str | None, media_type: str | None
) -> tuple[str, bytes, str]:
    if isinstance(file, bytes):
        # Bytes without a name are sent as plain text; name them (``notes.md``) or give
        # their media type for anything else.
        content, name = file, filename or "document.txt"
    else:
        path = Path(file)
        content, name = path.read_bytes(), filename or path.name
    return name, content, media_type or guess_media_type(name)


def guess_media_type(filename: str) -> str:
    suffix = Path(filename).suffix.lower()
    if suffix in {".md", ".markdown"}:
        return "text/markdown"
    guessed, _ = mimetypes.guess_type(filename)
    return guessed or "application/octet-stream"


def token_position(token: str) -> int:
    """A search token (``"16/B374D848"``, a WAL position) as a number, to keep the newest."""
    high, _, low = token.partition("/")
    return (int(high, 16) << 32) | int(low, 16)


@dataclass
class TokenMemory:
    """The newest search token this client was handed; every search passes it as ``after``,
    so a search sees at least what the client waited for, on whichever replica answers."""

    newest: str | None = None

    def remember(self, token: str | None) -> None:
        if token is None:
            return
        if self.newest is None or token_position(token) > token_position(self.newest):
            self.newest = token

    def after(self, given: Sequence[str] | None) -> list[str] | None:
        tokens = list(given or [])
        if self.newest is not None and self.newest not in tokens:
            tokens.append(self.newest)
        return tokens or None


@dataclass(frozen=True)
class BulkItem:
    """One file of a bulk request: a new document (``title``) or a new version of one
    (``document_id``), published with ``read``."""

    file: FileInput
    read: Sequence[str]
    title: str | None = None
    document_id: uuid.UUID | str | None = None
    filename: str | None = None
    media_type: str | None = None

    def entry(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"acl": {"read": list(self.read)}}
        if self.title is not None:
            entry["title"] = self.title
        if self.document_id is not None:
            entry["documentId"] = str(self.document_id)
        return entry


@dataclass(frozen=True)
class BulkDelete:
    """One delete in a bulk request: ``document_id`` at ``revision`` (the revision last
    read), as ``delete_document`` does; it sends no file."""

    document_id: uuid.UUID | str
    revision: int

    def entry(self) -> dict[str, Any]:
        return {"documentId": str(self.document_id), "delete": True, "revision": int(self.revision)}


@dataclass(frozen=True)
class BulkErase:
    """One erase in a bulk request: ``document_id``, as ``erase_document`` does (an admin
    key only: with another, the item answers 403 on its own); it sends no file."""

    document_id: uuid.UUID | str

    def entry(self) -> dict[str, Any]:
        return {"documentId": str(self.document_id), "erase": True}


# What one item of a bulk request may be.
BulkEntry = BulkItem | BulkDelete | BulkErase


@dataclass(frozen=True)
class Published:
    """A version that has become searchable, and the token that makes searches see it."""

    document_id: uuid.UUID
    version_number: int
    revision: int
    search_token: str | None
    status: DocumentStatusResponse = field(repr=False)


def is_searchable(status: DocumentStatusResponse, version: int) -> bool:
    """Whether search serves ``version`` or a later one (a search ordered after it sees no
    older one); raises when ``version`` never will be served."""
    if status.index_status is IndexStatus.DELETED:
        # Final: nothing of it is ever served again, so a wait would only run to its timeout.
        raise DocumentDeleted(
            status=409,
            code="DOCUMENT_DELETED",
            detail=f"document {status.document_id} was deleted at {status.deleted_at}",
        )
    served = status.search_version
    if served is not None and served >= version:
        return True
    published = status.published_version
    if published is not None and published > version:
        raise VersionSuperseded(
            f"version {published} of {status.document_id} was published after {version}"
        )
    if status.index_status is IndexStatus.FAILED and status.failure is not None:
        raise IndexingFailed(
            str(status.document_id), version, status.failure.error_code, status.failure.message
        )
    return False


def pause_for(
    policy: RetryPolicy,
    call: Call,
    error: KbClientError | httpx.TransportError,
    attempt: int,
    started: float,
) -> float | None:
    """How long to wait before sending ``call`` again; None: raise ``error`` now."""
    if not retriable(call, error) or attempt + 1 >= policy.max_attempts:
        return None
    pause = policy.delay(attempt, getattr(error, "retry_after", None))
    if time.monotonic() - started + pause > policy.deadline_seconds:
        return None
    return pause


def final_error(error: KbClientError | httpx.TransportError, base_url: str) -> KbClientError:
    if isinstance(error, KbClientError):
        return error
    # The httpx error holds the request (and its headers): only its kind goes further.
    return TransportError(f"{type(error).__name__} talking to {base_url}")


def title_of(file: FileInput, filename: str | None) -> str:
    if filename:
        return Path(filename).stem
    if isinstance(file, bytes):
        return "document"
    return Path(file).stem


def poll_delay(attempt: int) -> float:
    return min(1.0, 0.05 * 2.0 ** min(attempt, 10))
