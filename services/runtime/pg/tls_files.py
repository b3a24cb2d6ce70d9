"""The TLS files a ``DATABASE_URL`` names, loaded before the first connection.

asyncpg loads them while it connects, and a file that is missing, unreadable or not a valid
certificate, key or CRL fails with an ``OSError`` (``FileNotFoundError``, ``ssl.SSLError``)
like a Unix socket whose server is down, which ``translate_db_errors`` must keep retriable:
a process started with a wrong ``sslrootcert=`` would wait for the database for ever.
Loaded here first, into a context of the same kind and by the same calls, such a file is a
``ConfigError`` naming the parameter and the path (never the URL nor ``sslpassword``).

Only the files asyncpg (0.32) would load are checked, and only when it would: none when
TLS is off (``sslmode=disable``, or no ``sslmode`` and only Unix-socket hosts); from
``allow`` up the client certificate (the URL's, else ``PGSSLCERT``, else
``~/.postgresql/postgresql.crt``) with its key (likewise, else ``postgresql.key``): a key
without a certificate is never read. From ``require`` up, where asyncpg verifies the
server, the root certificate and the revocation list (likewise, else ``root.crt`` and
``root.crl``). A default file is checked only when it exists: asyncpg skips it else.
``sslmode`` is read as asyncpg reads it: ``verify_full`` is ``verify-full``.
"""

from __future__ import annotations

import os
import ssl
import urllib.parse
from collections.abc import Callable, Mapping
from pathlib import Path

from services.runtime.errors import ConfigError

# sslmode values, weakest first, spelt as asyncpg parses them (``-`` read as ``_``).
_MODES = ("disable", "allow", "prefer", "require", "verify_ca", "verify_full")
# (URL parameter, its environment variable, the default in ~/.postgresql): the files that
# verify the server, loaded from ``require``.
_VERIFY_FILES = (
    ("sslrootcert", "PGSSLROOTCERT", "root.crt"),
    ("sslcrl", "PGSSLCRL", "root.crl"),
)


def check_tls_files(dsn: str, environ: Mapping[str, str] | None = None) -> None:
    """Raises ``ConfigError`` when a TLS file the connection would load cannot be loaded."""
    env = os.environ if environ is None else environ
    parsed = urllib.parse.urlsplit(dsn)
    query = dict(urllib.parse.parse_qsl(parsed.query))  # the last of a repeated one, as asyncpg
    mode = query.get("sslmode") or env.get("PGSSLMODE") or _default_mode(parsed, query, env)
    mode = mode.replace("-", "_")
    if mode not in _MODES:
        return  # asyncpg refuses the mode itself (ClientConfigurationError: a ConfigError)
    level = _MODES.index(mode)
    if level < _MODES.index("allow"):
        return
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if level >= _MODES.index("require"):
        for parameter, variable, default in _VERIFY_FILES:
            named = _named(query, env, parameter, variable) or _default_file(env, default)
            if named is not None:
                _load(named, lambda path: context.load_verify_locations(cafile=path))
    _check_client_pair(context, query, env)


def _check_client_pair(
    context: ssl.SSLContext, query: Mapping[str, str], env: Mapping[str, str]
) -> None:
    """The client certificate with its key, when asyncpg would load them: only with a
    certificate, named or the default one."""
    cert = _named(query, env, "sslcert", "PGSSLCERT") or _default_file(env, "postgresql.crt")
    if cert is None:
        return
    key = _named(query, env, "sslkey", "PGSSLKEY") or _default_file(env, "postgresql.key")
    password = query.get("sslpassword") or ""
    _check_readable(cert)
    if key is None:
        _load(cert, lambda path: context.load_cert_chain(path, password=lambda: password))
        return
    _check_readable(key)
    try:
        context.load_cert_chain(cert[1], keyfile=key[1], password=lambda: password)
    except ssl.SSLError as error:
        # The certificate alone tells which of the two is bad; else the key is (not its
        # pair, or not to be opened with the password given).
        _load(cert, ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations)
        raise _invalid(key, error) from None


def _named(
    query: Mapping[str, str], env: Mapping[str, str], parameter: str, variable: str
) -> tuple[str, str] | None:
    """(the name to show, the path) of the URL's parameter, else of its variable."""
    if query.get(parameter):
        return parameter, query[parameter]
    if env.get(variable):
        return variable, env[variable]
    return None


def _default_file(env: Mapping[str, str], name: str) -> tuple[str, str] | None:
    """``~/.postgresql/<name>`` when it exists: asyncpg loads it then, and skips it else."""
    home = env.get("HOME") or (os.path.expanduser("~") if env is os.environ else None)
    if not home or home == "~":
        return None
    path = Path(home, ".postgresql", name)
    return (f"~/.postgresql/{name}", str(path)) if path.is_file() else None


def _load(named: tuple[str, str], loader: Callable[[str], object]) -> None:
    _check_readable(named)
    try:
        loader(named[1])
    except ssl.SSLError as error:
        raise _invalid(named, error) from None


def _check_readable(named: tuple[str, str]) -> None:
    name, path = named
    try:
        with open(path, "rb"):
            pass
    except OSError as error:
        raise ConfigError(
            f"database TLS file {name}={path} cannot be read: {error.strerror or error}"
        ) from None


def _invalid(named: tuple[str, str], error: ssl.SSLError) -> ConfigError:
    name, path = named
    return ConfigError(
        f"database TLS file {name}={path} cannot be loaded: {error.reason or error.strerror}"
    )


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
