"""A TLS file the database URL names is loaded before the first connection, as asyncpg
would load it (services/runtime/pg/tls_files.py): missing, unreadable or not a valid
certificate, key or CRL, it is a ConfigError naming the parameter and the path, never a
password; a file asyncpg would not read is not asked for."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from services.runtime.errors import ConfigError
from services.runtime.pg.db import connect, create_pool
from services.runtime.pg.tls_files import check_tls_files
from services.runtime.settings import RuntimeSettings
from tests.support.tls import KEY_PASSWORD, Pki, make_pki

PASSWORD = "s3cretpw"
BASE = f"postgresql://kb:{PASSWORD}@127.0.0.1:1/kb"


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return make_pki(tmp_path)


@pytest.mark.parametrize("parameter", ["sslrootcert", "sslcert", "sslkey", "sslcrl"])
def test_a_missing_file_named_by_the_url_is_a_config_error(parameter: str, pki: Pki) -> None:
    missing = pki.ca.parent / "absent.pem"
    # The key is read only with a certificate: named here, the certificate is a good one.
    cert = f"&sslcert={pki.cert}" if parameter == "sslkey" else ""
    with pytest.raises(ConfigError) as caught:
        check_tls_files(f"{BASE}?sslmode=verify-full&{parameter}={missing}{cert}", {})
    assert f"{parameter}={missing}" in caught.value.message
    assert PASSWORD not in caught.value.message
    assert not caught.value.retriable


def test_a_directory_in_place_of_the_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="sslrootcert"):
        check_tls_files(f"{BASE}?sslmode=require&sslrootcert={tmp_path}", {})


def test_the_environment_variable_is_checked_when_the_url_names_none(tmp_path: Path) -> None:
    missing = str(tmp_path / "absent.pem")
    with pytest.raises(ConfigError, match=f"PGSSLROOTCERT={missing}"):
        check_tls_files(f"{BASE}?sslmode=verify-ca", {"PGSSLROOTCERT": missing})
    with pytest.raises(ConfigError, match=f"PGSSLCERT={missing}"):
        check_tls_files(BASE, {"PGSSLCERT": missing})  # TCP: prefer, the cert is sent


def test_valid_files_pass(pki: Pki) -> None:
    check_tls_files(
        f"{BASE}?sslmode=verify-full&sslrootcert={pki.ca}&sslcert={pki.cert}&sslkey={pki.key}"
        f"&sslcrl={pki.crl}",
        {},
    )
    check_tls_files(
        f"{BASE}?sslmode=require&sslcert={pki.cert}&sslkey={pki.encrypted_key}"
        f"&sslpassword={KEY_PASSWORD}",
        {},
    )


def _truncated(pki: Pki) -> Path:
    path = pki.ca.parent / "truncated.pem"
    path.write_text("-----BEGIN CERTIFICATE-----\n")
    return path


def _not_pem(pki: Pki) -> Path:
    path = pki.ca.parent / "not.pem"
    path.write_text("a certificate, they said\n")
    return path


# (what is wrong, the URL's TLS parameters, the parameter the message names)
BAD_FILES = [
    ("truncated root", lambda p: f"sslrootcert={_truncated(p)}", "sslrootcert"),
    ("root not PEM", lambda p: f"sslrootcert={_not_pem(p)}", "sslrootcert"),
    ("CRL not PEM", lambda p: f"sslrootcert={p.ca}&sslcrl={_not_pem(p)}", "sslcrl"),
    ("cert not PEM", lambda p: f"sslcert={_not_pem(p)}&sslkey={p.key}", "sslcert"),
    ("key of another", lambda p: f"sslcert={p.cert}&sslkey={p.other_key}", "sslkey"),
    ("no password", lambda p: f"sslcert={p.cert}&sslkey={p.encrypted_key}", "sslkey"),
    (
        "wrong password",
        lambda p: f"sslcert={p.cert}&sslkey={p.encrypted_key}&sslpassword={PASSWORD}",
        "sslkey",
    ),
]


@pytest.mark.parametrize(
    ("parameters", "named"), [case[1:] for case in BAD_FILES], ids=[c[0] for c in BAD_FILES]
)
def test_a_readable_file_asyncpg_cannot_load_is_a_config_error(
    parameters: Callable[[Pki], str], named: str, pki: Pki
) -> None:
    """Else asyncpg's ssl.SSLError, an OSError, reads as a database that is away."""
    with pytest.raises(ConfigError) as caught:
        check_tls_files(f"{BASE}?sslmode=verify-full&{parameters(pki)}", {})
    assert f"{named}=" in caught.value.message
    assert PASSWORD not in caught.value.message
    assert KEY_PASSWORD not in caught.value.message
    assert not caught.value.retriable


@pytest.mark.parametrize("mode", ["verify_full", "verify_ca"])
def test_the_underscore_spellings_asyncpg_accepts_are_checked(mode: str, tmp_path: Path) -> None:
    missing = tmp_path / "absent.pem"
    with pytest.raises(ConfigError, match=f"sslrootcert={missing}"):
        check_tls_files(f"{BASE}?sslmode={mode}&sslrootcert={missing}", {})


def test_a_key_without_a_certificate_is_not_read(tmp_path: Path) -> None:
    """A stale PGSSLKEY with no certificate: asyncpg never opens it, so neither does the
    check (no ~/.postgresql/postgresql.crt either)."""
    missing = str(tmp_path / "absent.key")
    check_tls_files(f"{BASE}?sslmode=verify-full", {"PGSSLKEY": missing, "HOME": str(tmp_path)})
    check_tls_files(f"{BASE}?sslmode=require&sslkey={missing}", {"HOME": str(tmp_path)})


def test_the_default_certificate_brings_the_key_in(pki: Pki, tmp_path: Path) -> None:
    """With ~/.postgresql/postgresql.crt present asyncpg loads it, with the named key."""
    home = tmp_path / "home"
    (home / ".postgresql").mkdir(parents=True)
    (home / ".postgresql" / "postgresql.crt").write_bytes(pki.cert.read_bytes())
    env = {"HOME": str(home), "PGSSLKEY": str(pki.key)}
    check_tls_files(f"{BASE}?sslmode=require", env)
    with pytest.raises(ConfigError, match="PGSSLKEY="):
        check_tls_files(f"{BASE}?sslmode=require", env | {"PGSSLKEY": str(pki.other_key)})


def test_files_asyncpg_would_not_read_are_not_asked_for(tmp_path: Path) -> None:
    missing = str(tmp_path / "absent.pem")
    for parameter in ("sslrootcert", "sslcert", "sslkey", "sslcrl"):
        check_tls_files(f"{BASE}?sslmode=disable&{parameter}={missing}", {})
        # No sslmode and a Unix socket: no TLS at all.
        check_tls_files(f"postgresql://kb@%2Ftmp/kb?{parameter}={missing}", {})
    # Below require asyncpg does not verify the server: its CA file is not read.
    check_tls_files(f"{BASE}?sslmode=prefer&sslrootcert={missing}", {})
    check_tls_files(f"{BASE}?sslrootcert={missing}", {"PGSSLMODE": "allow"})


async def test_the_pool_and_a_connection_refuse_before_connecting(tmp_path: Path) -> None:
    # Port 1: were a connection tried, its refusal would be a retriable DatabaseUnavailable.
    settings = RuntimeSettings(
        database_url=f"{BASE}?sslmode=verify-full&sslrootcert={tmp_path / 'absent.pem'}"
    )
    with pytest.raises(ConfigError, match="sslrootcert"):
        await create_pool(settings)
    with pytest.raises(ConfigError, match="sslrootcert"):
        await connect(settings)


def test_a_bad_default_root_certificate_is_a_config_error(tmp_path: Path) -> None:
    """asyncpg loads ~/.postgresql/root.crt from require up when none is named; absent, it
    is skipped (verify-full then fails in asyncpg itself, a ConfigError)."""
    home = tmp_path / "home"
    (home / ".postgresql").mkdir(parents=True)
    check_tls_files(f"{BASE}?sslmode=require", {"HOME": str(home)})
    (home / ".postgresql" / "root.crt").write_text("not a certificate\n")
    check_tls_files(f"{BASE}?sslmode=prefer", {"HOME": str(home)})
    with pytest.raises(ConfigError, match=r"~/\.postgresql/root\.crt="):
        check_tls_files(f"{BASE}?sslmode=require", {"HOME": str(home)})
