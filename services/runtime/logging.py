"""structlog JSON logs. The event name is the action (``task.claimed``, ``lease.lost``);
ids travel as fields, never inside the event name.

Ours and the standard library's lines alike hold no secret, no frame's locals and a bounded
number of bytes (services/runtime/log_safety.py)."""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog
from structlog.typing import Processor

from services.runtime.log_safety import AlreadyLogged, BoundedRenderer, Redacted, SafeExceptions
from services.runtime.redaction import environment_secrets
from services.runtime.tracing.logs import add_trace_ids

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


def configure_logging(level: str = "info", fmt: str = "json", *, service: str = "kb") -> None:
    structured = fmt == "json"
    renderer = BoundedRenderer(
        structlog.processors.JSONRenderer()
        if structured
        # Its default exception formatter shows locals; it never sees an exception anyway.
        else structlog.dev.ConsoleRenderer(
            colors=False, exception_formatter=structlog.dev.plain_traceback
        )
    )
    # The environment's secrets, read once: masked in every line (KB_* keys, the DSN's
    # password).
    safe: list[Processor] = [SafeExceptions(structured=structured), Redacted(environment_secrets())]
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            add_trace_ids,
            *safe,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        # Logs go to stderr: stdout of CLI commands is reserved for machine-readable output.
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.bind_contextvars(service=service)
    _route_library_logs(_LEVELS[level], renderer, safe)


# Client libraries log every failed reconnect while a broker is away (several a second);
# our own code logs an outage once, with its action name, and counts it in a metric.
_QUIET_UNLESS_DEBUG = ("aiokafka", "kafka")
# httpx logs every request at INFO (every embedding request of an indexer); the parsers
# trace tokens; at debug level they are all there.
_WARNINGS_UNLESS_DEBUG = ("httpx", "httpcore", "markdown_it")


def _route_library_logs(level: int, renderer: Any, safe: list[Processor]) -> None:
    """Standard-library loggers (uvicorn, aiokafka, asyncio) render like ours: one JSON
    object per line on stderr, with a timestamp and a level, through the same safety
    processors; an exception our code logged already is not logged again."""
    handler = _StderrHandler()
    handler.addFilter(AlreadyLogged())
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processor=renderer,
            foreign_pre_chain=[
                structlog.contextvars.merge_contextvars,
                structlog.stdlib.add_log_level,
                structlog.stdlib.add_logger_name,
                structlog.processors.TimeStamper(fmt="iso", utc=True),
                add_trace_ids,
                *safe,
            ],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # A library that configured its own loggers (uvicorn's default config gives `uvicorn`
    # a handler of its own and stops it propagating) would write around the safety chain:
    # every named logger goes through the root's one handler.
    for logger in list(logging.Logger.manager.loggerDict.values()):
        if isinstance(logger, logging.Logger):
            logger.handlers.clear()
            logger.propagate = True
    for name in _QUIET_UNLESS_DEBUG:
        logging.getLogger(name).setLevel(level if level <= logging.DEBUG else logging.CRITICAL)
    # A line per request or per parser token: what we log of them is our own event.
    for name in _WARNINGS_UNLESS_DEBUG:
        logging.getLogger(name).setLevel(level if level <= logging.DEBUG else logging.WARNING)


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is when a record is emitted (not when logging was
    configured), so a replaced or captured stderr never leaves it writing to a closed file."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def get_logger(name: str | None = None) -> structlog.stdlib.BoundLogger:
    logger: structlog.stdlib.BoundLogger = structlog.get_logger(name)
    return logger
