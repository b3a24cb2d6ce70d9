"""What a log line may hold: no secret, no frame's locals, and a bounded number of bytes.

Every line -- ours and the standard-library loggers' (uvicorn, starlette, asyncio, aiokafka)
-- goes through the same processors before it is rendered:

- :class:`SafeExceptions`: an exception is rendered as its type, message and frames (file,
  line, function), never its frames' local variables (a route's locals hold the caller's
  credentials), at most ``MAX_FRAMES`` frames a stack and ``MAX_CHAINED`` chained stacks;
- :class:`Redacted`: every value, the exception's message included, goes through
  :func:`services.runtime.redaction.redact` (key-shaped strings, ``password=...``, bearer
  tokens, URL passwords, the environment's secrets); an object is logged as its ``repr``,
  redacted;
- :class:`BoundedRenderer`: each string at most ``MAX_VALUE_CHARS``, each list or mapping at
  most ``MAX_ITEMS`` items, and the rendered line at most ``MAX_LINE_BYTES`` (the exception
  is cut to its innermost frames first, then every value, then the line is replaced by its
  event, level and ``truncated_bytes``).

An exception is logged once: our own handler logs a request's unhandled exception, and the
server's "Exception in ASGI application" for the same exception object is dropped
(:class:`AlreadyLogged`).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterable, Mapping
from types import TracebackType
from typing import Any, Final

from structlog.tracebacks import ExceptionDictTransformer
from structlog.typing import EventDict, WrappedLogger

from services.runtime.redaction import redact

MAX_LINE_BYTES: Final = 8 * 1024
MAX_VALUE_CHARS: Final = 2048
MAX_ITEMS: Final = 50
# Half the outermost frames (the server's), half the innermost (where it failed).
MAX_FRAMES: Final = 16
MAX_CHAINED: Final = 3
# What is left of an exception when the line is still too long: its innermost frames.
_LAST_RESORT_FRAMES: Final = 4
_SHORT_VALUE_CHARS: Final = 256
# A string is searched for secrets up to here: well beyond the cut, so a secret the cut
# splits is never printed in part.
_REDACTED_CHARS: Final = 4 * MAX_VALUE_CHARS

_LOGGED: Final = "_kb_logged"
_PLAIN: Final = (str, int, float, bool, type(None))
# What structlog's ProcessorFormatter carries along and removes before rendering.
_FORMATTER_META: Final = frozenset({"_record", "_from_structlog"})

ExcInfo = tuple[type[BaseException], BaseException, TracebackType | None]


def mark_logged(error: BaseException) -> None:
    """Say ``error`` is in the log already: a later record of it is dropped."""
    # An exception type with __slots__ cannot be marked: logged twice, no harm.
    with contextlib.suppress(AttributeError):
        setattr(error, _LOGGED, True)


def was_logged(error: BaseException | None) -> bool:
    return error is not None and getattr(error, _LOGGED, False) is True


class AlreadyLogged(logging.Filter):
    """Drops a standard-library record of an exception our code logged already (uvicorn's
    "Exception in ASGI application" after the app's own handler answered and logged it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc_info = record.exc_info
        return not (isinstance(exc_info, tuple) and was_logged(exc_info[1]))


def _exc_info(value: Any) -> ExcInfo | None:
    if isinstance(value, BaseException):
        return (type(value), value, value.__traceback__)
    if isinstance(value, tuple):  # (None, None, None): logged outside any exception
        return value if len(value) == 3 and isinstance(value[1], BaseException) else None
    if value:
        current = sys.exc_info()
        return None if current[1] is None else current
    return None


class SafeExceptions:
    """``exc_info`` replaced by an ``exception`` without locals: a list of stacks (JSON), or
    the traceback's text (console). The exception is marked logged (:class:`AlreadyLogged`)."""

    def __init__(self, *, structured: bool = True) -> None:
        self._structured = structured
        self._transform = ExceptionDictTransformer(
            show_locals=False, max_frames=MAX_FRAMES, use_rich=False
        )

    def __call__(self, logger: WrappedLogger, name: str, event: EventDict) -> EventDict:
        if "exc_info" in event:
            exc_info = _exc_info(event.pop("exc_info"))
            if exc_info is not None:
                mark_logged(exc_info[1])
                event["exception"] = self._render(exc_info)
        return event

    def _render(self, exc_info: ExcInfo) -> Any:
        if self._structured:
            return self._transform(exc_info)[:MAX_CHAINED]
        import traceback

        # Plain text, no locals; the frames are capped like the structured ones'.
        lines = traceback.format_exception(*exc_info, limit=-MAX_FRAMES)
        return "".join(lines[-MAX_FRAMES * 2 :])


class Redacted:
    """Every value of the event with its credentials masked, objects as their ``repr``."""

    def __init__(self, secrets: Iterable[str]) -> None:
        self._secrets = frozenset(secrets)

    def __call__(self, logger: WrappedLogger, name: str, event: EventDict) -> EventDict:
        return {
            key: value if key in _FORMATTER_META else self._clean(value)
            for key, value in event.items()
        }

    def _clean(self, value: Any) -> Any:
        if isinstance(value, str):
            # What lies beyond is cut before rendering anyway; not searched, it costs nothing.
            return redact(value[:_REDACTED_CHARS], secrets=self._secrets)
        if isinstance(value, _PLAIN):
            return value
        if isinstance(value, Mapping):
            return {str(k): self._clean(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self._clean(v) for v in value]
        return redact(repr(value)[:_REDACTED_CHARS], secrets=self._secrets)


def bounded(value: Any, chars: int = MAX_VALUE_CHARS) -> Any:
    """``value`` with each string cut to ``chars`` and each container to ``MAX_ITEMS``."""
    if isinstance(value, str):
        if len(value) <= chars:
            return value
        return f"{value[:chars]}...[{len(value) - chars} chars cut]"
    if isinstance(value, Mapping):
        items = list(value.items())
        kept = {str(k): bounded(v, chars) for k, v in items[:MAX_ITEMS]}
        if len(items) > MAX_ITEMS:
            kept["items_cut"] = len(items) - MAX_ITEMS
        return kept
    if isinstance(value, list | tuple):
        kept_list = [bounded(v, chars) for v in value[:MAX_ITEMS]]
        if len(value) > MAX_ITEMS:
            kept_list.append(f"...[{len(value) - MAX_ITEMS} items cut]")
        return kept_list
    return value


def _innermost(exception: Any) -> Any:
    if isinstance(exception, str):  # a traceback's text: where it failed is at its end
        return exception[-_SHORT_VALUE_CHARS * 4 :]
    if not isinstance(exception, list):
        return bounded(exception, _SHORT_VALUE_CHARS)
    return [
        {
            "exc_type": stack.get("exc_type"),
            "exc_value": bounded(stack.get("exc_value", ""), _SHORT_VALUE_CHARS),
            "frames": stack.get("frames", [])[-_LAST_RESORT_FRAMES:],
        }
        for stack in exception[:MAX_CHAINED]
        if isinstance(stack, dict)
    ]


_KEPT_WHOLE: Final = ("event", "level", "timestamp", "service", "logger")


class BoundedRenderer:
    """``renderer``'s line, at most ``MAX_LINE_BYTES`` long: cut step by step, and as a
    last resort replaced by the event's name and level and how long it would have been."""

    def __init__(self, renderer: Callable[..., Any], max_line_bytes: int = MAX_LINE_BYTES):
        self._renderer = renderer
        self._max = max_line_bytes

    def __call__(self, logger: WrappedLogger, name: str, event: EventDict) -> str:
        event = bounded(event)
        line = self._render(logger, name, event)
        if self._fits(line):
            return line
        full = len(line.encode())
        event = {**event, "truncated_bytes": full}
        if "exception" in event:
            event["exception"] = _innermost(event["exception"])
            line = self._render(logger, name, event)
        if not self._fits(line):
            event = bounded(event, _SHORT_VALUE_CHARS)
            line = self._render(logger, name, event)
        if not self._fits(line):
            kept = {k: bounded(event[k], _SHORT_VALUE_CHARS) for k in _KEPT_WHOLE if k in event}
            line = self._render(logger, name, kept | {"truncated_bytes": full})
        if not self._fits(line):  # an event name or a custom field beyond reason
            line = line.encode()[: self._max].decode(errors="ignore")
        return line

    def _fits(self, line: str) -> bool:
        return len(line.encode()) <= self._max

    def _render(self, logger: WrappedLogger, name: str, event: EventDict) -> str:
        # Renderers may consume the dict (the console one pops keys): each try gets a copy.
        line: str = self._renderer(logger, name, dict(event))
        return line
