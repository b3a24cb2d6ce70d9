"""Schemathesis, stateful, over the composed app's OpenAPI document and its links (issue 29):
calls chained along the links (upload -> publish -> status -> index task, search -> status,
bulk -> status...) with tenant A's key, against the real app (uvicorn, real PostgreSQL).
No answer is a 5xx, every answer conforms to the document, and no answer to A ever holds
anything only tenant B has: B's document and task ids, titles, texts, or any key.

Tenant B (globex) has searchable documents under the same principals as A's, and one
published through the API (so it has an index task): a search with A's key and the
principals of B's ACLs is where a missing tenant filter would show. Of the ids the fuzzer
makes up, half become B's and half A's own (chosen by the id itself), and one call in eight
goes to B's tenant path.

The run is derandomized: the same code sends the same calls, so a failure reproduces; the
first one is reported with the scenario's calls before it and a curl command.
"""

from __future__ import annotations

import json
import uuid
import zlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings
from hypothesis.errors import Flaky
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.core.failures import FailureGroup
from schemathesis.core.transport import Response
from schemathesis.generation.stateful.state_machine import APIStateMachine

from services.app import create_app
from services.embedding.settings import EmbeddingSettings, HashingConfig
from services.publisher.settings import PublisherSettings
from services.runtime.fair_share.settings import FairShareSettings
from services.search.statements import SearchSettings
from tests.security.world import DIMENSION, Tenant, world_data_in
from tests.support.api import UNTHROTTLED, live_app
from tests.support.operator import operator_settings

pytestmark = pytest.mark.integration

# About 350 calls; each operation below answers 2xx several times.
SCENARIOS = 60
STEPS_PER_SCENARIO = 6
# Calls a run makes at least, even if Hypothesis stops it early (see the test).
MIN_CALLS = 200
# Each answered 2xx at least once, or the run never got past refusals to the linked states.
REACHED = frozenset(
    {
        "POST /v1/tenants/{tenantId}/documents",
        "POST /v1/tenants/{tenantId}/documents/{documentId}/versions",
        "POST /v1/tenants/{tenantId}/documents/{documentId}/versions/{versionNumber}/publish",
        "POST /v1/tenants/{tenantId}/documents/bulk",
        "GET /v1/tenants/{tenantId}/documents/{documentId}",
        "DELETE /v1/tenants/{tenantId}/documents/{documentId}",
        "POST /v1/tenants/{tenantId}/documents/{documentId}/erase",
        "GET /v1/tenants/{tenantId}/index-tasks/{taskId}",
        "POST /v1/tenants/{tenantId}/search",
    }
)
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


@dataclass(frozen=True)
class Live:
    url: str
    schema: dict[str, Any]
    acme: Tenant
    # What only tenant B has: ids A's requests may name (and answers may then echo) ...
    other_ids: frozenset[str]
    other_document_ids: tuple[str, ...]
    other_task_ids: tuple[str, ...]
    # ... and what no answer to A may ever hold.
    secrets: frozenset[str]
    # Every principal B's ACLs name (A's name the same): a search with them reads whatever
    # its tenant filter lets through.
    principals: tuple[str, ...]


@pytest.fixture(scope="module")
async def live(module_database: str) -> AsyncIterator[Live]:
    acme, globex, operator_key, signing = await world_data_in(module_database)
    publisher_settings = PublisherSettings(database_url=module_database, db_pool_max_size=4)
    app = create_app(
        publisher_settings,
        search_settings=SearchSettings(database_url=module_database),
        embedding_settings=EmbeddingSettings(provider=HashingConfig(dimensions=DIMENSION)),
        operator_settings=operator_settings(module_database),
        auth_settings=UNTHROTTLED,
        # A 429 is documented and fine, but would cut chains short at random.
        fair_share_settings=FairShareSettings(enabled=False),
    )
    marker = f"globex-only-{uuid.uuid4().hex}"
    with live_app(app, publisher_settings) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            document_id, task_id = await _publish_through_api(client, globex, marker)
        secrets = {marker, operator_key, signing.hmac_secret}
        for tenant in (acme, globex):
            secrets.update(key for _, key in tenant.keys.values())
        for document in globex.documents:
            secrets.update((document.title, document.text))
        document_ids = (*(str(d.document_id) for d in globex.documents), document_id)
        yield Live(
            url=url,
            schema=app.openapi(),
            acme=acme,
            other_ids=frozenset((*document_ids, task_id)),
            other_document_ids=document_ids,
            other_task_ids=(task_id,),
            secrets=frozenset(secrets),
            principals=tuple(sorted({p for d in globex.documents for p in d.read})),
        )


async def _publish_through_api(
    client: httpx.AsyncClient, tenant: Tenant, marker: str
) -> tuple[str, str]:
    """Tenant B's document uploaded and published over HTTP: (document id, task id)."""
    headers = {"Authorization": f"Bearer {tenant.keys['admin'][1]}"}
    created = await client.post(
        f"/v1/tenants/{tenant.tenant_id}/documents",
        files={"file": ("b.txt", f"handbook {marker}".encode(), "text/plain")},
        data={"title": f"Title {marker}"},
        headers=headers,
    )
    assert created.status_code == 201, created.text
    document_id: str = created.json()["documentId"]
    published = await client.post(
        f"/v1/tenants/{tenant.tenant_id}/documents/{document_id}/versions/1/publish",
        json={"revision": created.json()["revision"], "acl": {"read": ["group:support"]}},
        headers=headers,
    )
    assert published.status_code == 202, published.text
    return document_id, published.json()["indexTaskId"]


def _pick(value: object) -> int | None:
    """A stable number from a value the fuzzer made, which decides its substitution
    (Python's ``hash`` of a string changes per process; the run must replay exactly)."""
    if not isinstance(value, str):
        return None
    try:
        return uuid.UUID(value).int
    except ValueError:
        return zlib.crc32(value.encode())


def _is_uuid(value: object) -> bool:
    try:
        uuid.UUID(str(value))
    except ValueError:
        return False
    return True


def _printable(values: object) -> list[str]:
    if not isinstance(values, list):
        return []
    return [v for v in values if isinstance(v, str) and v.isprintable() and v.strip()]


def _realistic(case: schemathesis.Case[Any], live: Live) -> None:
    """Valid values where the document's types allow what the API refuses (a title with
    control characters, bytes that are not the file's type, a blank query, 3.0 for an
    integer): negative cases, and the stateless test (tests/integration/
    test_api_schemathesis.py), send those; here a positive case must succeed to lead on."""
    body: Any = case.body
    if not isinstance(body, dict):
        return
    if "items" in body:
        # A bulk publish of one to three files; with two or more, the second is a new
        # version of one of tenant B's documents (refused, and refused blind).
        files = body.get("file")
        count = min(max(len(files) if isinstance(files, list) else 0, 1), 3)
        items: list[dict[str, Any]] = [
            {"title": f"Bulk {n}", "acl": {"read": ["group:support"]}} for n in range(count)
        ]
        if count > 1:
            others = live.other_document_ids
            other = others[zlib.crc32(str(body["items"]).encode()) % len(others)]
            items[1] = {"documentId": other, "acl": {"read": ["group:support"]}}
        body["items"] = json.dumps(items)
        body["file"] = [f"handbook bulk {n}".encode() for n in range(count)]
        case.multipart_content_types = {"file": "text/plain"}
    elif "file" in body:
        text = body["file"] if isinstance(body["file"], str) else ""
        body["file"] = f"handbook {text if text.isprintable() else ''}".encode()
        case.multipart_content_types = {"file": "text/plain"}
    for name in ("revision", "topK"):
        # 3.0 is an integer to JSON Schema, not to the API's strict integers: refused (422).
        if isinstance(body.get(name), float) and body[name].is_integer():
            body[name] = int(body[name])
    if isinstance(body.get("title"), str) and not body["title"].isprintable():
        body["title"] = "Handbook"
    acl = body.get("acl")
    if isinstance(acl, dict) and "read" in acl:
        acl["read"] = _printable(acl["read"])
    if isinstance(body.get("query"), str):
        if not (body["query"].isprintable() and body["query"].strip()):
            body["query"] = "handbook"
        body.pop("principalToken", None)
        body["principals"] = _printable(body.get("principals")) or list(live.principals)


_ID_KINDS = {"documentId": "documentId", "indexTaskId": "taskId", "taskId": "taskId"}


def _ids_in(value: Any) -> Iterator[tuple[str, str]]:
    """(kind, id) of every document and task id in an answer."""
    if isinstance(value, dict):
        for key, item in value.items():
            if key in _ID_KINDS and isinstance(item, str):
                yield _ID_KINDS[key], item
            else:
                yield from _ids_in(item)
    elif isinstance(value, list):
        for item in value:
            yield from _ids_in(item)


def _is_json(response: Response) -> bool:
    return (response.headers.get("content-type") or [""])[0].startswith("application/json")


def _anything_of_b(live: Live, response: Response) -> str | None:
    """What of tenant B (or which key) the answer holds, named without showing it whole."""
    answer = response.text + json.dumps(dict(response.headers))
    for secret in live.secrets:
        if secret in answer:
            return f"tenant B's data or a key ({secret[:10]}...)"
    request = response.request
    body = request.body
    sent = (request.url or "") + (
        body.decode(errors="replace") if isinstance(body, bytes) else str(body or "")
    )
    for other in live.other_ids:
        if other not in sent:
            if other in answer:
                return f"tenant B's id {other}"
        elif other in (request.url or "") and response.status_code in {200, 201, 202, 409}:
            # Named in the path, B's id must be as unknown as a made-up one (a 404, which
            # echoes the id A sent).
            return f"an answer about tenant B's {other}"
    return None


class _Run:
    """What a run saw, across its scenarios."""

    def __init__(self, acme: Tenant) -> None:
        # Every id in A's answers: links carry them, and they are left as they are.
        self.seen: set[str] = set()
        # A's documents and tasks to put in place of made-up ids: those made before the run,
        # then those A's POSTs made, in that order (not the order of a search's hits, which
        # varies between runs), so that the same pick takes the same one in every run.
        self.own: dict[str, dict[str, None]] = {
            "documentId": {str(d.document_id): None for d in acme.documents},
            "taskId": {},
        }
        self.reached: set[str] = set()
        self.calls = 0
        self.failures: list[str] = []


def _state_machine(live: Live, run: _Run) -> type[APIStateMachine]:
    schema = schemathesis.openapi.from_dict(live.schema)
    base = schema.as_state_machine()
    acme = live.acme

    class TenantAWithBsIds(base):  # type: ignore[misc, valid-type]
        steps: list[str]

        def setup(self) -> None:
            self.steps = []

        def get_call_kwargs(self, case: schemathesis.Case[Any]) -> dict[str, Any]:
            return {
                "base_url": live.url,
                "headers": {"Authorization": f"Bearer {acme.keys['admin'][1]}"},
                # A 500's traceback, rendered by the tests' console logger, is slow to write.
                "timeout": 120,
            }

        def call(self, case: schemathesis.Case[Any], **kwargs: Any) -> Response:
            try:
                response: Response = super().call(case, **kwargs)
            except Exception as error:
                run.failures.append(_report(self.steps, case, error))
                raise
            return response

        def before_call(self, case: schemathesis.Case[Any]) -> None:
            if case.meta is not None and case.meta.generation.mode.is_positive:
                _realistic(case, live)
            path = case.path_parameters
            if path is None:
                return
            if "tenantId" in path:
                pick = _pick(path["tenantId"])
                # One call in eight on B's path with A's key: refused, and refused blind.
                path["tenantId"] = "globex" if pick is not None and pick % 8 == 0 else "acme"
            substituted = self._substitute(path, "documentId", "documentId")
            self._substitute(path, "taskId", "taskId")
            if substituted and isinstance(path.get("versionNumber"), int):
                # Version 1, or 2 if the document has one.
                path["versionNumber"] = 1 + path["versionNumber"] % 2
            flt: Any = case.body.get("filter") if isinstance(case.body, dict) else None
            if isinstance(flt, dict) and isinstance(flt.get("documentIds"), list):
                for index in range(len(flt["documentIds"])):
                    self._substitute(flt["documentIds"], index, "documentId")

        def _substitute(self, where: Any, key: Any, kind: str) -> bool:
            """In place of a well-formed id the fuzzer made up (which would only be a 404), one
            of tenant B's for half of them, else one of A's own. Links' ids are left alone."""
            try:
                value = where[key]
            except (KeyError, IndexError):
                return False
            own = run.own[kind]
            pick = _pick(value)
            if value in run.seen or pick is None or not _is_uuid(value):
                return False
            if pick % 2 == 0:
                others = live.other_document_ids if kind == "documentId" else live.other_task_ids
                where[key] = others[pick % len(others)]
            elif own:
                where[key] = list(own)[pick % len(own)]
            return True

        def after_call(self, response: Response, case: schemathesis.Case[Any]) -> None:
            super().after_call(response, case)
            run.calls += 1
            self.steps.append(f"{case.method} {response.request.url} -> {response.status_code}")
            if 200 <= response.status_code < 300 and _is_json(response):
                for kind, value in _ids_in(response.json()):
                    run.seen.add(value)
                    if case.method == "POST" and not case.path.endswith("/search"):
                        run.own[kind][value] = None
                run.reached.add(f"{case.method} {case.path}")

        def validate_response(
            self,
            response: Response,
            case: schemathesis.Case[Any],
            additional_checks: Any = None,
            **kwargs: Any,
        ) -> None:
            try:
                leak = _anything_of_b(live, response)
                if leak is not None:
                    raise AssertionError(f"the answer holds {leak}")
                if response.status_code >= 400:
                    content_type = response.headers.get("content-type") or [""]
                    if content_type[0] != "application/problem+json":
                        raise AssertionError(f"an error answered as {content_type[0]!r}")
                case.validate_response(
                    response,
                    checks=CHECKS,
                    transport_kwargs=kwargs or None,
                    recorder=self.recorder,
                )
            except (AssertionError, FailureGroup) as error:
                run.failures.append(_report(self.steps, case, error))
                raise

    return TenantAWithBsIds


def _report(steps: list[str], case: schemathesis.Case[Any], error: BaseException) -> str:
    if isinstance(error, FailureGroup):
        what = "; ".join(f"{f.title}: {f.message}" for f in error.exceptions)
    else:
        what = str(error)
    calls = "\n  ".join(steps)
    return f"{what}\nthe scenario's calls:\n  {calls}\nthe last one: {case.as_curl_command()}"


def test_chained_calls_with_one_tenants_key_never_reach_anothers_data(live: Live) -> None:
    run = _Run(live.acme)
    machine = _state_machine(live, run)
    for _ in range(3):
        try:
            machine.run(
                settings=settings(
                    max_examples=SCENARIOS,
                    stateful_step_count=STEPS_PER_SCENARIO,
                    deadline=None,
                    derandomize=True,
                    database=None,
                    # No shrinking: the server's state has moved on, a replay is another run.
                    phases=[Phase.generate],
                    suppress_health_check=list(HealthCheck),
                )
            )
        except (AssertionError, FailureGroup):
            if not run.failures:
                raise
        except Flaky:
            # Hypothesis found a scenario it had run go another way the second time (a replay
            # after a failure, or a prefix of an earlier scenario): the server's state moved
            # on. The calls made until then were all checked; schemathesis's own runner
            # counts this as done too. Too few calls by then, and the run goes on afresh.
            if not run.failures and run.calls < MIN_CALLS:
                continue
        break
    if run.failures:
        pytest.fail(run.failures[0], pytrace=False)
    assert run.calls >= MIN_CALLS
    assert run.reached == REACHED, f"no 2xx from {sorted(REACHED - run.reached)}"
