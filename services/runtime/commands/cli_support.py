"""How every `kb` command reads its settings and turns errors into exit codes and messages.

Exit 0 on success, 2 on bad input or configuration (the caller must change something),
1 on any other failure. No traceback for an error the tree knows. Every message printed
here goes through :func:`services.runtime.redaction.redact` first: an error about a bad
``DATABASE_URL`` must not print its password.
"""

from __future__ import annotations

import asyncio
import sys
import traceback
from collections.abc import Coroutine
from typing import Any, NoReturn, TypeVar

from pydantic import ValidationError
from pydantic_settings import BaseSettings

from services.runtime.errors import BadInput, ConfigError, KbError, NotFound
from services.runtime.redaction import redact

T = TypeVar("T")
S = TypeVar("S", bound=BaseSettings)

EXIT_FAILURE = 1
EXIT_BAD_INPUT = 2


def describe_validation_error(error: ValidationError) -> str:
    """Which settings are wrong and why -- never the offending values (pydantic's own
    ``str(error)`` repeats each input, a password in a URL included)."""
    problems = [
        f"{'.'.join(str(part) for part in e['loc']) or 'value'}: {e['msg']}"
        for e in error.errors(include_input=False, include_url=False)
    ]
    return redact("invalid configuration: " + "; ".join(problems))


def load_settings(settings_class: type[S], **overrides: Any) -> S:
    """Read ``settings_class`` from the environment (plus ``overrides``); a setting that
    does not validate is a ``ConfigError`` whose message names it without its value."""
    try:
        return settings_class(**overrides)
    except ValidationError as error:
        raise ConfigError(describe_validation_error(error)) from None


def error_line(error: BaseException) -> str:
    """The one line `kb` prints on stderr for ``error``, credentials masked."""
    if isinstance(error, KbError):
        return redact(f"error: {error.message} [{error.code}]")
    if isinstance(error, ValidationError):
        return f"error: {describe_validation_error(error)} [{ConfigError.code}]"
    return redact(f"error: {type(error).__name__}: {error}")


def exit_code(error: BaseException) -> int:
    bad_input = isinstance(error, BadInput | ConfigError | NotFound | ValidationError)
    return EXIT_BAD_INPUT if bad_input else EXIT_FAILURE


def fail(error: BaseException) -> NoReturn:
    """Print ``error`` (redacted) on stderr and exit: one line for an error the tree knows,
    the traceback too for anything else (a bug)."""
    if not isinstance(error, KbError | ValidationError):
        trace = "".join(traceback.format_exception(error))
        print(redact(trace.rstrip()), file=sys.stderr)
    print(error_line(error), file=sys.stderr)
    sys.exit(exit_code(error))


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)
