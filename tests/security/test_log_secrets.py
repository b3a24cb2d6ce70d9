"""The logs of a whole run hold no credential and no document text (issue 29).

`kb serve`, `kb relay run` and `kb indexer run` run as processes at the most verbose level
(KB_LOG_LEVEL=debug, library loggers included), over a DATABASE_URL with a password. A
tenant, keys, an HMAC verification key and an operator key are made with `kb` as an operator
would; then a Markdown document whose text holds a unique marker is uploaded, published
with an ACL, indexed and searched (with the key's principals, and with a principal token);
a wrong key, a forged token and an operator key on /v1 are refused; the operator signs in
to /ui and opens the document. Every byte the processes wrote (the services' stdout and
stderr, the commands' stderr, and their stdout but for the key each prints by design) is
scanned for each secret: none may appear, whole or as its secret part.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import asyncpg
import httpx
import jwt
import pytest

from services.operator.auth import SESSION_COOKIE
from tests.e2e.test_searchable import pipeline_services, wait_for_status, wait_ready
from tests.support.api import free_port
from tests.support.cli import kb_async
from tests.support.operator import sign_in

pytestmark = pytest.mark.e2e

WAIT = 120.0
ACL = "group:vault-readers"


@dataclass(frozen=True)
class Secret:
    name: str
    value: str


@dataclass
class Command:
    """A `kb` command's output: stderr is a log; stdout may print one secret, by design."""

    args: tuple[str, ...]
    out: str
    err: str
    prints: str | None = None


async def _kb(env: dict[str, str], *args: str, stdin: bytes | None = None) -> Command:
    code, out, err = await kb_async(env, *args, stdin=stdin, seconds=WAIT)
    assert code == 0, f"kb {' '.join(args)}: {err[-2000:]}"
    return Command(args, out, err)


def _printed(command: Command, name: str) -> str:
    for line in command.out.splitlines():
        if line.startswith(f"{name}="):
            command.prints = line.removeprefix(f"{name}=")
            return command.prints
    raise AssertionError(f"kb {' '.join(command.args)} printed no {name}: {command.out}")


async def _database_url_with_password(database_url: str) -> tuple[str, Secret]:
    """The test database's URL with a password in it: its own, or one added when the server
    does not check it (the test stack trusts local connections). A server that checks
    passwords and a URL without one: the user and host part must not be printed instead."""
    parts = urlsplit(database_url)
    if parts.password:
        return database_url, Secret("the database password", parts.password)
    password = f"pw-{uuid.uuid4().hex}"
    userinfo = f"{quote(parts.username or 'postgres')}:{password}"
    with_password = urlunsplit(parts._replace(netloc=f"{userinfo}@{parts.hostname}:{parts.port}"))
    try:
        conn = await asyncpg.connect(with_password)
    except (asyncpg.PostgresError, OSError):
        return database_url, Secret("the database URL's user@host", parts.netloc)
    await conn.close()
    return with_password, Secret("the database password", password)


def _token(secret: str, principals: list[str], kid: str = "hs") -> str:
    now = int(time.time())
    claims = {"sub": "user:ann", "aud": "kb:acme", "iat": now, "exp": now + 300}
    return jwt.encode({**claims, "principals": principals}, secret, "HS256", headers={"kid": kid})


def _parts(secret: Secret) -> Iterator[Secret]:
    """A secret, and the part of it that is secret on its own (a key's after its tenant, a
    JWT's signature): printing that alone is a leak too."""
    yield secret
    value = secret.value
    if value.startswith(("kb.", "kbop.")):
        yield Secret(f"{secret.name} (its secret part)", value.rsplit(".", 1)[-1])
    elif value.count(".") == 2 and value.startswith("eyJ"):
        yield Secret(f"{secret.name} (its signature)", value.rsplit(".", 1)[-1])


def _leaks(where: str, text: str, secrets: list[Secret]) -> Iterator[str]:
    for number, line in enumerate(text.splitlines(), start=1):
        found = [s for s in secrets if s.value in line]
        if found:
            shown = line
            for secret in found:
                shown = shown.replace(secret.value, f"<{secret.name}>")
            names = ", ".join(s.name for s in found)
            yield f"{where}:{number}: {names}: {shown[:300]}"


@dataclass
class Credentials:
    admin_key: str
    web_key: str  # a search key that requires a principal token
    operator_key: str
    hmac_secret: str
    commands: list[Command]


async def _operator_commands(env: dict[str, str]) -> Credentials:
    """What an operator makes with `kb`: a tenant (its admin key), a key for end users'
    apps, an HMAC verification key (from stdin) and an operator key."""
    hmac_secret = f"hmac-{uuid.uuid4().hex}{uuid.uuid4().hex}"
    tenant = await _kb(env, "tenants", "create", "acme", "--tier", "standard")
    web_key_args = ("--scope", "search", "--require-principal-token", "--name", "web")
    hmac_args = ("--kid", "hs", "--hmac-secret-file", "-")
    web, verification, operator = await asyncio.gather(
        _kb(env, "tenants", "keys", "create", "acme", *web_key_args),
        _kb(
            env,
            "tenants",
            "verification-keys",
            "add",
            "acme",
            *hmac_args,
            stdin=hmac_secret.encode(),
        ),
        _kb(env, "operators", "create", "ops"),
    )
    return Credentials(
        admin_key=_printed(tenant, "KB_API_KEY"),
        web_key=_printed(web, "KB_API_KEY"),
        operator_key=_printed(operator, "KB_OPERATOR_KEY"),
        hmac_secret=hmac_secret,
        commands=[tenant, web, verification, operator],
    )


async def _use_the_api(
    root: str, credentials: Credentials, marker: str, watched: list[Any]
) -> tuple[str, list[Secret]]:
    """Publish the marked document, wait until it is searchable, search it both ways, and
    be refused three ways; the document's path, and the credentials sent on the way."""
    base = "/v1/tenants/acme"
    admin = {"Authorization": f"Bearer {credentials.admin_key}"}
    web = {"Authorization": f"Bearer {credentials.web_key}"}
    async with httpx.AsyncClient(base_url=root, headers=admin, timeout=30) as client:
        text = f"# Vault\n\nThe code is {marker}.\n"
        uploaded = await client.post(
            f"{base}/documents",
            files={"file": ("vault.md", text, "text/markdown")},
            data={"title": "Vault"},
        )
        assert uploaded.status_code == 201, uploaded.text
        document = f"{base}/documents/{uploaded.json()['documentId']}"
        published = await client.post(
            f"{document}/versions/1/publish",
            json={"revision": uploaded.json()["revision"], "acl": {"read": [ACL]}},
        )
        assert published.status_code == 202, published.text
        await wait_for_status(client, document, "SEARCHABLE", watched)

        query = {"query": "vault code", "topK": 3}
        found = await client.post(f"{base}/search", json={**query, "principals": [ACL]})
        assert found.status_code == 200, found.text
        # The marker went all the way through: what the scan looks for was there to log.
        assert marker in found.json()["results"][0]["text"]
        token = _token(credentials.hmac_secret, [ACL])
        by_token = await client.post(
            f"{base}/search", json={**query, "principalToken": token}, headers=web
        )
        assert by_token.status_code == 200, by_token.text
        assert by_token.json()["results"]

        admin_key = credentials.admin_key
        wrong_key = admin_key[:-8] + ("B" * 8 if admin_key.endswith("A" * 8) else "A" * 8)
        forged = _token(f"not-{credentials.hmac_secret}", [ACL, "group:everyone"])
        refused = [
            await client.get(document, headers={"Authorization": f"Bearer {wrong_key}"}),
            await client.get(
                document, headers={"Authorization": f"Bearer {credentials.operator_key}"}
            ),
            await client.post(
                f"{base}/search", json={**query, "principalToken": forged}, headers=web
            ),
        ]
        assert [r.status_code for r in refused] == [401, 401, 401], [r.text for r in refused]
    return document, [
        Secret("the principal token", token),
        Secret("a wrong key", wrong_key),
        Secret("a forged principal token", forged),
    ]


async def _use_the_operator_page(root: str, operator_key: str, document: str) -> list[Secret]:
    """Sign in with the operator key and open the document's page; the session cookie."""
    async with httpx.AsyncClient(base_url=root, timeout=30) as client:
        signed_in = await sign_in(client, operator_key)
        assert (signed_in.status_code, signed_in.headers.get("location")) == (303, "/ui")
        page = await client.get(document.replace("/v1/tenants/", "/ui/tenants/"))
        assert page.status_code == 200, page.text
        session = client.cookies.get(SESSION_COOKIE)
    return [Secret("the operator's session cookie", session)] if session else []


def _scan(logs: dict[str, Path], commands: list[Command], secrets: list[Secret]) -> list[str]:
    secrets = [part for secret in secrets for part in _parts(secret)]
    leaks: list[str] = []
    for name, log in logs.items():
        leaks += _leaks(f"kb {name} (stdout and stderr)", log.read_text(errors="replace"), secrets)
    for command in commands:
        shown = f"kb {' '.join(command.args[:3])}"
        leaks += _leaks(f"{shown} (stderr)", command.err, secrets)
        others = [s for s in secrets if s.value not in (command.prints or "")]
        leaks += _leaks(f"{shown} (stdout)", command.out, others)
    return leaks


async def test_a_whole_run_logs_no_key_password_token_or_document_text(
    service_env: dict[str, str], tmp_path: Path
) -> None:
    database_url, database_secret = await _database_url_with_password(service_env["DATABASE_URL"])
    operator_token = f"op-token-{uuid.uuid4().hex}"
    marker = f"VAULT-{uuid.uuid4().hex}"
    env = {
        **service_env,
        "DATABASE_URL": database_url,
        "KB_LOG_LEVEL": "debug",
        "KB_LOG_FORMAT": "json",
        "KB_EMBEDDING_PROVIDER": "hashing",
        "KB_INDEXER_POLL_SECONDS": "0.5",
        "KB_OPERATOR_TOKEN": operator_token,
        "KB_OPERATOR_SECURE_COOKIE": "false",  # the page is used over plain HTTP below
    }
    port = free_port()
    root = f"http://127.0.0.1:{port}"
    with ExitStack() as services:
        logs, watched = pipeline_services(services, env, tmp_path, port)
        credentials = await _operator_commands(env)  # while the services start
        await wait_ready(root, *watched[0])
        document, sent = await _use_the_api(root, credentials, marker, watched)
        sent += await _use_the_operator_page(root, credentials.operator_key, document)
    # Leaving the ExitStack stopped each service (SIGTERM) and checked it exited 0.

    leaks = _scan(
        logs,
        credentials.commands,
        [
            database_secret,
            Secret("the tenant admin key", credentials.admin_key),
            Secret("the tenant search key", credentials.web_key),
            Secret("the operator key", credentials.operator_key),
            Secret("KB_OPERATOR_TOKEN", operator_token),
            Secret("the HMAC secret", credentials.hmac_secret),
            Secret("the document's text", marker),
            *sent,
        ],
    )
    if leaks:
        pytest.fail("secrets in the logs:\n" + "\n".join(leaks[:20]), pytrace=False)
    # The run logged at debug level (had it not, the scan would have proved less).
    assert any('"level": "debug"' in log.read_text() for log in logs.values())
