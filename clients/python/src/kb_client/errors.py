"""Every failure the client raises: one tree under ``KbClientError``.

A problem+json answer becomes a ``ProblemError`` subclass chosen by its status (and, for the
codes a caller branches on, by its ``code``), carrying the server's stable ``code``,
``status`` and ``retry_after``. Messages hold the server's code and detail, never a request's
headers: an API key or principal token cannot reach a message, a repr or a traceback's
``__cause__`` (answers are raised ``from None``).
"""

from __future__ import annotations

from typing import Any

from kb_client.models import FieldError


class KbClientError(Exception):
    """Anything the client raises."""


class ProblemError(KbClientError):
    """The server answered with a problem+json body."""

    def __init__(
        self,
        *,
        status: int,
        code: str,
        detail: str,
        title: str = "",
        retry_after: float | None = None,
        errors: list[FieldError] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(f"{status} {code}: {detail}")
        self.status = status
        self.code = code
        self.detail = detail
        self.title = title
        self.retry_after = retry_after
        self.errors = errors or []
        self.extra = extra or {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(status={self.status}, code={self.code!r})"


class BadRequest(ProblemError):
    """400: the request is wrong as sent."""


class Unauthenticated(ProblemError):
    """401: no key, a wrong or revoked key, or a principal token that does not verify."""


class Forbidden(ProblemError):
    """403: the key may not do this (scope, tenant)."""


class NotFound(ProblemError):
    """404."""


class Conflict(ProblemError):
    """409: the document changed in between, or the version is superseded."""


class RevisionConflict(Conflict):
    """409 REVISION_CONFLICT: read the document's status again and retry with its revision."""

    @property
    def current_revision(self) -> int | None:
        value = self.extra.get("currentRevision")
        return value if isinstance(value, int) else None


class DocumentDeleted(Conflict):
    """409 DOCUMENT_DELETED: the document was deleted, for good; it takes no new version or
    publish (upload the content as a new document). Also raised by a wait on a deleted
    document, which would otherwise never end."""


class PayloadTooLarge(ProblemError):
    """413."""


class UnsupportedMediaType(ProblemError):
    """415."""


class ValidationFailed(ProblemError):
    """422: a field is out of its bounds, or a search token is ahead of the database."""


class RateLimited(ProblemError):
    """429: the tenant's fair share is used up; ``retry_after`` says when to come back."""


class ServiceUnavailable(ProblemError):
    """503: the database or the embedding provider is unavailable for now."""


class ServerError(ProblemError):
    """Any other 5xx."""


_BY_STATUS: dict[int, type[ProblemError]] = {
    400: BadRequest,
    401: Unauthenticated,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    413: PayloadTooLarge,
    415: UnsupportedMediaType,
    422: ValidationFailed,
    429: RateLimited,
    503: ServiceUnavailable,
}
_BY_CODE: dict[str, type[ProblemError]] = {
    "REVISION_CONFLICT": RevisionConflict,
    "DOCUMENT_DELETED": DocumentDeleted,
}


def problem_class(status: int, code: str) -> type[ProblemError]:
    if code in _BY_CODE:
        return _BY_CODE[code]
    if status in _BY_STATUS:
        return _BY_STATUS[status]
    return ServerError if status >= 500 else ProblemError


class TransportError(KbClientError):
    """The server could not be reached, or the connection broke (after the retries)."""


class DeadlineExceeded(KbClientError):
    """A call (with its retries) or a wait ran past its deadline."""


class IndexingFailed(KbClientError):
    """The version being waited for ended FAILED: ``code`` is the indexer's stable code."""

    def __init__(self, document_id: str, version: int, code: str, message: str | None) -> None:
        super().__init__(f"version {version} of {document_id} failed to index: {code}")
        self.document_id = document_id
        self.version = version
        self.code = code
        self.message = message


class VersionSuperseded(KbClientError):
    """A newer version was published while waiting: the one waited for will never be served."""
