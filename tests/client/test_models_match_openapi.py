"""kb-client's models and calls are the server's (issue 45): every schema the client
models has the same fields, the same required ones and the same types as the composed app's
OpenAPI document (the one `kb serve` answers at /openapi.json, search included); every
tenant operation has a client method, whose request goes to the operation's path with its
method and form fields. A change on either side without the other fails here."""

from __future__ import annotations

import re
import uuid
from typing import Any

import pytest
from kb_client import AsyncKbClient, BulkItem, KbClient
from kb_client._core import Call
from kb_client._requests import OPERATIONS, ClientBase
from kb_client.models import ENUMS, SCHEMAS
from pydantic import BaseModel

from services.app import create_app
from services.publisher.settings import PublisherSettings

Shape = Any


@pytest.fixture(scope="module")
def document() -> dict[str, Any]:
    app = create_app(PublisherSettings(database_url="postgresql://unused/kb"))
    schema: dict[str, Any] = app.openapi()
    return schema


def shape(schema: dict[str, Any], defs: dict[str, Any]) -> Shape:
    """A property's type, without its bounds, descriptions or defaults."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        target = defs[name]
        if "enum" in target:
            return ("enum", name, tuple(sorted(target["enum"])))
        return ("ref", name)
    if "anyOf" in schema:
        return ("anyOf", frozenset(shape(choice, defs) for choice in schema["anyOf"]))
    kind = schema.get("type")
    if kind == "array":
        return ("array", shape(schema["items"], defs))
    if kind == "string":
        return ("string", schema.get("format"))
    assert kind in {"integer", "number", "boolean", "null"}, schema
    return (kind,)


def described(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    return {
        "required": sorted(schema.get("required", [])),
        "properties": {
            name: shape(prop, defs) for name, prop in schema.get("properties", {}).items()
        },
    }


def client_schema(model: type[BaseModel]) -> tuple[dict[str, Any], dict[str, Any]]:
    schema = model.model_json_schema(by_alias=True, ref_template="#/$defs/{model}")
    return schema, schema.get("$defs", {})


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_each_model_matches_its_schema(document: dict[str, Any], name: str) -> None:
    server_defs = document["components"]["schemas"]
    assert name in server_defs, f"the server has no schema {name} any more"
    ours, our_defs = client_schema(SCHEMAS[name])
    assert described(ours, our_defs) == described(server_defs[name], server_defs)


@pytest.mark.parametrize("name", sorted(ENUMS))
def test_each_enum_matches_its_schema(document: dict[str, Any], name: str) -> None:
    server = document["components"]["schemas"][name]["enum"]
    assert sorted(e.value for e in ENUMS[name]) == sorted(server)


def test_every_server_schema_is_modelled(document: dict[str, Any]) -> None:
    """A new schema in the server's document is one the client must learn (or state here
    why not: the multipart bodies are sent as form fields, checked below)."""
    multipart = {"Body_add_version", "Body_create_document"}
    operational = {"HealthResponse"}  # /healthz, not a tenant endpoint
    unmodelled = set(document["components"]["schemas"]) - set(SCHEMAS) - set(ENUMS)
    assert unmodelled == multipart | operational


def _tenant_operations(document: dict[str, Any]) -> dict[str, tuple[str, str, dict[str, Any]]]:
    found = {}
    for path, operations in document["paths"].items():
        if path.startswith("/v1/tenants/"):
            for method, operation in operations.items():
                found[operation["operationId"]] = (method.upper(), path, operation)
    return found


def test_every_tenant_operation_has_a_client_method(document: dict[str, Any]) -> None:
    assert set(_tenant_operations(document)) == set(OPERATIONS)
    for method in OPERATIONS.values():
        assert callable(getattr(KbClient, method))
        assert callable(getattr(AsyncKbClient, method))


def _calls(client: ClientBase) -> dict[str, Call]:
    doc, task = uuid.uuid4(), uuid.uuid4()
    return {
        "create_document": client._create_document(b"x", "title", "a.md", None),
        "add_version": client._add_version(doc, b"x", "a.md", None),
        "publish_version": client._publish(doc, 2, 1, ["group:all"]),
        "publish_many": client._publish_many([BulkItem(b"x", ["group:all"], title="t")]),
        "document_status": client._status(doc),
        "delete_document": client._delete(doc, 3),
        "erase_document": client._erase(doc),
        "add_ingest_key": client._add_ingest_key("k1", "a" * 43),
        "list_ingest_keys": client._list_ingest_keys(),
        "revoke_ingest_key": client._revoke_ingest_key("k1"),
        "index_task": client._index_task(task),
        "search": client._search(
            "q",
            principals=["group:all"],
            principal_token=None,
            mode="hybrid",
            top_k=3,
            document_ids=None,
            heading_prefix=None,
            after=None,
        ),
    }


def _form_fields(operation: dict[str, Any], document: dict[str, Any]) -> set[str]:
    schema = operation["requestBody"]["content"]["multipart/form-data"]["schema"]
    if "$ref" in schema:
        schema = document["components"]["schemas"][schema["$ref"].rsplit("/", 1)[-1]]
    return set(schema["properties"])


def test_each_call_goes_where_the_document_says(document: dict[str, Any]) -> None:
    client = ClientBase("http://kb.test", "kb.acme.secret")
    operations = _tenant_operations(document)
    for operation_id, call in _calls(client).items():
        method, template, operation = operations[operation_id]
        pattern = "^" + re.sub(r"\{[^}]+\}", "[^/]+", template) + "$"
        assert call.method == method, operation_id
        assert re.match(pattern, call.path), (operation_id, call.path, template)
        query = {p["name"] for p in operation.get("parameters", []) if p["in"] == "query"}
        assert set(call.params or {}) == query, operation_id
        content = operation.get("requestBody", {}).get("content", {})
        if "multipart/form-data" in content:
            sent = set(call.data or {}) | {name for name, _ in call.files or []}
            assert sent == _form_fields(operation, document), operation_id
        elif "application/json" in content:
            assert call.json is not None, operation_id
