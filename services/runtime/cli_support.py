"""How every `kb` command turns errors into exit codes and messages.

Exit 0 on success, 2 on bad input or configuration (the caller must change something),
1 on any other failure. No traceback for an error the tree knows.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Coroutine
from typing import Any, NoReturn, TypeVar

from services.runtime.errors import BadInput, ConfigError, KbError, NotFound

T = TypeVar("T")

EXIT_FAILURE = 1
EXIT_BAD_INPUT = 2


def fail(error: KbError) -> NoReturn:
    print(f"error: {error.message} [{error.code}]", file=sys.stderr)
    bad_input = isinstance(error, BadInput | ConfigError | NotFound)
    sys.exit(EXIT_BAD_INPUT if bad_input else EXIT_FAILURE)


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)
