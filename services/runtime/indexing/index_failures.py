"""Why an indexing attempt failed: the stable codes, which of them another attempt may cure,
and the error that carries one. Shared vocabulary: the embedding providers and search raise
these, the indexer's retry policy (``services.indexer.retry``) keys on them, the
operator reads them. See docs/architecture.md#retries-and-failure-codes.
"""

from __future__ import annotations

from typing import ClassVar, Final

from services.runtime.errors import KbError
from services.runtime.redaction import redact as redact_secrets


class ErrorCode:
    """Stable failure codes (docs/architecture.md#retries-and-failure-codes). Policy keys on
    these, never on message text."""

    UNSUPPORTED_DOCUMENT: ClassVar[str] = "UNSUPPORTED_DOCUMENT"
    DOCUMENT_PARSE_FAILED: ClassVar[str] = "DOCUMENT_PARSE_FAILED"
    DOCUMENT_TOO_LARGE: ClassVar[str] = "DOCUMENT_TOO_LARGE"
    # Parsed fine, but no text to index (a scanned PDF without a text layer).
    DOCUMENT_EMPTY: ClassVar[str] = "DOCUMENT_EMPTY"
    # Parsing ran past the per-document budget (a pathological PDF).
    DOCUMENT_PARSE_TIMEOUT: ClassVar[str] = "DOCUMENT_PARSE_TIMEOUT"
    EMBEDDING_RATE_LIMITED: ClassVar[str] = "EMBEDDING_RATE_LIMITED"
    EMBEDDING_TIMEOUT: ClassVar[str] = "EMBEDDING_TIMEOUT"
    EMBEDDING_UNAVAILABLE: ClassVar[str] = "EMBEDDING_UNAVAILABLE"
    # A 200 whose body is not an embeddings answer at all (not JSON, no ``data`` list): maybe
    # a proxy's error page. Provider-side and transient, unlike EMBEDDING_RESPONSE_INVALID.
    EMBEDDING_RESPONSE_MALFORMED: ClassVar[str] = "EMBEDDING_RESPONSE_MALFORMED"
    # An embeddings answer with the wrong vector count, indices or dimension, or NaN: terminal.
    EMBEDDING_RESPONSE_INVALID: ClassVar[str] = "EMBEDDING_RESPONSE_INVALID"
    EMBEDDING_MODEL_CHANGED: ClassVar[str] = "EMBEDDING_MODEL_CHANGED"
    LEASE_ATTEMPTS_EXHAUSTED: ClassVar[str] = "LEASE_ATTEMPTS_EXHAUSTED"
    DOCUMENT_VERSION_MISSING: ClassVar[str] = "DOCUMENT_VERSION_MISSING"
    # An exception the code did not expect: a bug. It is not dressed up as retryable.
    INTERNAL_ERROR: ClassVar[str] = "INTERNAL_ERROR"
    # The task's search generation was retired before it finished (`kb index generations
    # retire` ends its unfinished tasks with it, then deletes them).
    GENERATION_RETIRED: ClassVar[str] = "GENERATION_RETIRED"
    # The task's document was deleted (docs/architecture.md#document-lifecycle): the delete
    # ends its unfinished tasks with it, and a completion that finds the search pointer a
    # tombstone writes nothing and ends with it. A delete is final: no attempt can cure it.
    DOCUMENT_DELETED: ClassVar[str] = "DOCUMENT_DELETED"
    # The task's version was superseded and retention removed its content (KB_RETENTION_*):
    # a requeue or re-run of an old version's task has nothing to read. Final for the
    # version; publish a new one.
    VERSION_CONTENT_REMOVED: ClassVar[str] = "VERSION_CONTENT_REMOVED"


TERMINAL_CODES: Final[frozenset[str]] = frozenset(
    {
        ErrorCode.UNSUPPORTED_DOCUMENT,
        ErrorCode.DOCUMENT_PARSE_FAILED,
        ErrorCode.DOCUMENT_TOO_LARGE,
        ErrorCode.DOCUMENT_EMPTY,
        ErrorCode.DOCUMENT_PARSE_TIMEOUT,
        # Terminal for this attempt's model: a new model means a new index and a new task.
        ErrorCode.EMBEDDING_RESPONSE_INVALID,
        ErrorCode.EMBEDDING_MODEL_CHANGED,
        ErrorCode.LEASE_ATTEMPTS_EXHAUSTED,
        ErrorCode.DOCUMENT_VERSION_MISSING,
        ErrorCode.INTERNAL_ERROR,
        ErrorCode.GENERATION_RETIRED,
        ErrorCode.DOCUMENT_DELETED,
        ErrorCode.VERSION_CONTENT_REMOVED,
    }
)

# The indexer's own transient codes. Infrastructure errors (services.runtime.errors:
# DatabaseUnavailable, DatabaseBusy, ...) are not listed: their ``retriable`` flag says so.
RETRYABLE_CODES: Final[frozenset[str]] = frozenset(
    {
        ErrorCode.EMBEDDING_RATE_LIMITED,
        ErrorCode.EMBEDDING_TIMEOUT,
        ErrorCode.EMBEDDING_UNAVAILABLE,
        ErrorCode.EMBEDDING_RESPONSE_MALFORMED,
    }
)

# Failures on the provider's side, not the document's: they follow a time budget from the
# task's first such failure (KB_INDEXER_PROVIDER_FAILURE_BUDGET_SECONDS), not the attempt
# count, and feed the shared breaker. See docs/architecture.md#retries-and-failure-codes.
PROVIDER_FAILURE_CODES: Final[frozenset[str]] = frozenset(
    {
        ErrorCode.EMBEDDING_RATE_LIMITED,
        ErrorCode.EMBEDDING_TIMEOUT,
        ErrorCode.EMBEDDING_UNAVAILABLE,
        ErrorCode.EMBEDDING_RESPONSE_MALFORMED,
    }
)


class IndexingFailed(KbError):
    """What a ``DocumentVersionIndexer`` raises: a stable code, a message for operators
    (redacted before it is stored), whether another attempt may succeed (by default: what
    the code table says) and, for rate limits, the provider's Retry-After."""

    # Instances always carry the precise code; this is only the class's own name for it.
    code = "INDEXING_FAILED"

    def __init__(
        self,
        code: str,
        message: str,
        *,
        retry_after_seconds: float | None = None,
        retriable: bool | None = None,
    ) -> None:
        super().__init__(message, code=code)
        self.retry_after_seconds = retry_after_seconds
        # An instance carries its own flag, as it carries its own code.
        self.retriable = code in RETRYABLE_CODES if retriable is None else retriable  # type: ignore[misc]


_MAX_MESSAGE = 1000


def redact(message: str) -> str:
    """What may be stored in ``error_message``: credentials masked, length bounded."""
    message = redact_secrets(message)
    return message if len(message) <= _MAX_MESSAGE else message[: _MAX_MESSAGE - 1] + "…"
