"""One error tree for the whole system.

Every error has a stable ``code`` (what operators, metrics and retry policy key on) and a
``retriable`` flag (what callers branch on, never the message text). HTTP adapters map
``http_status`` to a problem+json answer; the CLI maps ``BadInput`` to exit 2.
"""

from __future__ import annotations

from typing import Any, ClassVar


class KbError(Exception):
    code: ClassVar[str] = "INTERNAL_ERROR"
    retriable: ClassVar[bool] = False
    http_status: ClassVar[int] = 500

    def __init_subclass__(
        cls,
        *,
        code: str | None = None,
        retriable: bool | None = None,
        http_status: int | None = None,
        **kwargs: Any,
    ) -> None:
        """A subclass names what it changes in its class line (``class NotFound(KbError,
        code="NOT_FOUND", http_status=404)``) and inherits the rest."""
        super().__init_subclass__(**kwargs)
        if code is not None:
            cls.code = code
        if retriable is not None:
            cls.retriable = retriable
        if http_status is not None:
            cls.http_status = http_status

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            # A subclass may carry a more precise code without a class of its own.
            self.code = code  # type: ignore[misc]

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


# --- caller mistakes: never retried, answered with a 4xx / exit 2 -------------------------


class BadInput(KbError, code="BAD_INPUT", http_status=400): ...


class ValidationFailed(BadInput, code="VALIDATION_FAILED", http_status=422): ...


class NotFound(KbError, code="NOT_FOUND", http_status=404): ...


class Conflict(KbError, code="CONFLICT", http_status=409): ...


class Unauthenticated(KbError, code="UNAUTHENTICATED", http_status=401): ...


class Forbidden(KbError, code="FORBIDDEN", http_status=403): ...


class PayloadTooLarge(BadInput, code="PAYLOAD_TOO_LARGE", http_status=413): ...


class UnsupportedMediaType(BadInput, code="UNSUPPORTED_MEDIA_TYPE", http_status=415): ...


# --- configuration and set-up ---------------------------------------------------------------


class ConfigError(KbError, code="CONFIG_INVALID", http_status=500):
    """The environment or a command line asks for something that cannot work."""


class MissingTool(ConfigError, code="MISSING_TOOL"):
    """A program the dev stack needs (java, mvn) is not installed."""


class MigrationError(KbError, code="MIGRATION_FAILED"): ...


class MigrationChecksumMismatch(MigrationError, code="MIGRATION_CHECKSUM_MISMATCH"):
    """An applied migration file was edited afterwards: the schema no longer matches it."""


# --- infrastructure: usually worth retrying ---------------------------------------------------


class DependencyUnavailable(
    KbError, code="DEPENDENCY_UNAVAILABLE", retriable=True, http_status=503
): ...


class DatabaseUnavailable(DependencyUnavailable, code="DATABASE_UNAVAILABLE"): ...


class DatabaseBusy(DependencyUnavailable, code="DATABASE_BUSY"):
    """The database is reachable but could not finish this statement now: a statement or
    lock timeout, a cancelled query, exhausted server resources. Another attempt later
    usually succeeds; a different code from ``DATABASE_UNAVAILABLE`` because it points
    operators at long locks and slow queries rather than at connectivity or failover."""


class KafkaUnavailable(DependencyUnavailable, code="KAFKA_UNAVAILABLE"): ...


class SerializationConflict(
    KbError, code="SERIALIZATION_CONFLICT", retriable=True, http_status=503
):
    """Two transactions collided (serialization failure or deadlock); run it again."""


# --- leases ------------------------------------------------------------------------------------


class LeaseLost(KbError, code="LOST_LEASE", http_status=409):
    """A fenced update touched no row: someone else owns the work now. Write nothing more."""
