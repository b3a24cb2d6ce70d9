"""One error tree for the whole system.

Every error has a stable ``code`` (what operators, metrics and retry policy key on) and a
``retriable`` flag (what callers branch on, never the message text). HTTP adapters map
``http_status`` to a problem+json answer; the CLI maps ``BadInput`` to exit 2.
"""

from __future__ import annotations

from typing import ClassVar


class KbError(Exception):
    code: ClassVar[str] = "INTERNAL_ERROR"
    retriable: ClassVar[bool] = False
    http_status: ClassVar[int] = 500

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            # A subclass may carry a more precise code without a class of its own.
            self.code = code  # type: ignore[misc]

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


# --- caller mistakes: never retried, answered with a 4xx / exit 2 -------------------------


class BadInput(KbError):
    code = "BAD_INPUT"
    http_status = 400


class ValidationFailed(BadInput):
    code = "VALIDATION_FAILED"
    http_status = 422


class NotFound(KbError):
    code = "NOT_FOUND"
    http_status = 404


class Conflict(KbError):
    code = "CONFLICT"
    http_status = 409


class Unauthenticated(KbError):
    code = "UNAUTHENTICATED"
    http_status = 401


class Forbidden(KbError):
    code = "FORBIDDEN"
    http_status = 403


class PayloadTooLarge(BadInput):
    code = "PAYLOAD_TOO_LARGE"
    http_status = 413


class UnsupportedMediaType(BadInput):
    code = "UNSUPPORTED_MEDIA_TYPE"
    http_status = 415


# --- configuration and set-up ---------------------------------------------------------------


class ConfigError(KbError):
    """The environment or a command line asks for something that cannot work."""

    code = "CONFIG_INVALID"
    http_status = 500


class MissingTool(ConfigError):
    """A program the dev stack needs (java, mvn) is not installed."""

    code = "MISSING_TOOL"


class MigrationError(KbError):
    code = "MIGRATION_FAILED"


class MigrationChecksumMismatch(MigrationError):
    """An applied migration file was edited afterwards: the schema no longer matches it."""

    code = "MIGRATION_CHECKSUM_MISMATCH"


# --- infrastructure: usually worth retrying ---------------------------------------------------


class DependencyUnavailable(KbError):
    code = "DEPENDENCY_UNAVAILABLE"
    retriable = True
    http_status = 503


class DatabaseUnavailable(DependencyUnavailable):
    code = "DATABASE_UNAVAILABLE"


class DatabaseBusy(DependencyUnavailable):
    """The database is reachable but could not finish this statement now: a statement or
    lock timeout, a cancelled query, exhausted server resources. Another attempt later
    usually succeeds; a different code from ``DATABASE_UNAVAILABLE`` because it points
    operators at long locks and slow queries rather than at connectivity or failover."""

    code = "DATABASE_BUSY"


class KafkaUnavailable(DependencyUnavailable):
    code = "KAFKA_UNAVAILABLE"


class SerializationConflict(KbError):
    """Two transactions collided (serialization failure or deadlock); run it again."""

    code = "SERIALIZATION_CONFLICT"
    retriable = True
    http_status = 503


# --- leases ------------------------------------------------------------------------------------


class LeaseLost(KbError):
    """A fenced update touched no row: someone else owns the work now. Write nothing more."""

    code = "LOST_LEASE"
    http_status = 409
