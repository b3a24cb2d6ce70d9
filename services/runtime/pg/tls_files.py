"""The TLS files a ``DATABASE_URL`` names, checked before the first connection.

asyncpg reads them while it connects, and a file that is missing or unreadable fails with
the same ``OSError`` (``FileNotFoundError``) as a Unix socket whose server is down, which
``translate_db_errors`` must keep retriable: a process started with a wrong ``sslrootcert=``
would wait for the database for ever. Read here first, such a file is a ``ConfigError``
naming the parameter and the path (never the URL, which may hold a password).

Only the files asyncpg (0.32) would read are checked: none when TLS is off (``sslmode=
disable``, or no ``sslmode`` and only Unix-socket hosts); the client certificate from
``allow`` up, and its key only with a certificate (named, or ``~/.postgresql/
postgresql.crt`` when it exists: asyncpg reads no key else); the root certificate and
revocation list from ``require`` up, where asyncpg verifies the server. Each is the URL's
parameter, else its ``PGSSL*`` variable.
``sslmode`` is read as asyncpg reads it: ``verify_full`` is ``verify-full``.
"""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import Mapping
from pathlib import Path

from services.runtime.errors import ConfigError

# sslmode values, weakest first, spelt as asyncpg parses them (``-`` read as ``_``).
_MODES = ("disable", "allow", "prefer", "require", "verify_ca", "verify_full")
# (URL parameter, its environment variable, the weakest sslmode at which asyncpg reads it).
_FILES = (
    ("sslcert", "PGSSLCERT", "allow"),
    ("sslkey", "PGSSLKEY", "allow"),
    ("sslrootcert", "PGSSLROOTCERT", "require"),
    ("sslcrl", "PGSSLCRL", "require"),
)


def check_tls_files(dsn: str, environ: Mapping[str, str] | None = None) -> None:
    """Raises ``ConfigError`` when a TLS file the connection would read cannot be read."""
    env = os.environ if environ is None else environ
    parsed = urllib.parse.urlsplit(dsn)
    query = dict(urllib.parse.parse_qsl(parsed.query))  # the last of a repeated one, as asyncpg
    mode = query.get("sslmode") or env.get("PGSSLMODE") or _default_mode(parsed, query, env)
    mode = mode.replace("-", "_")
    if mode not in _MODES:
        return  # asyncpg refuses the mode itself (ClientConfigurationError: a ConfigError)
    cert = query.get("sslcert") or env.get("PGSSLCERT") or _default_file(env, "postgresql.crt")
    for parameter, variable, weakest in _FILES:
        path = query.get(parameter) or env.get(variable)
        if parameter == "sslkey" and not cert:
            continue  # asyncpg reads the key only with a certificate
        if path and _MODES.index(mode) >= _MODES.index(weakest):
            _check_readable(parameter if parameter in query else variable, path)


def _default_mode(
    parsed: urllib.parse.SplitResult, query: Mapping[str, str], env: Mapping[str, str]
) -> str:
    """asyncpg's mode when none is named: ``prefer`` when a host is reached by TCP, TLS off
    when every host is a Unix socket directory."""
    hostspec = parsed.netloc.rpartition("@")[2] or query.get("host") or env.get("PGHOST", "")
    hosts = [urllib.parse.unquote(host) for host in hostspec.split(",") if host]
    if hosts and all(host.startswith("/") for host in hosts):
        return "disable"
    return "prefer"  # a TCP host, or none named: asyncpg's default list holds localhost


def _default_file(env: Mapping[str, str], name: str) -> str | None:
    """``~/.postgresql/<name>`` when it exists: asyncpg loads it then, and skips it else."""
    home = env.get("HOME") or (os.path.expanduser("~") if env is os.environ else None)
    if not home or home == "~":
        return None
    path = Path(home, ".postgresql", name)
    return str(path) if path.is_file() else None


def _check_readable(name: str, path: str) -> None:
    try:
        with open(path, "rb"):
            pass
    except OSError as error:
        raise ConfigError(
            f"database TLS file {name}={path} cannot be read: {error.strerror or error}"
        ) from None
