"""The committed OpenAPI document and the SQL of the publisher agree with the code."""

from __future__ import annotations

import re

from services.publisher.store_pg import QUERIES
from services.publisher.web.openapi import OPENAPI_PATH, generate, render


def test_committed_openapi_document_matches_the_app() -> None:
    committed = OPENAPI_PATH.read_text(encoding="utf-8")
    assert committed == render(generate()), (
        "services/publisher/web/openapi.json is stale: "
        "run `uv run python -m services.publisher.web.openapi`"
    )


def test_the_openapi_document_covers_the_contract() -> None:
    schema = generate()
    paths = schema["paths"]
    assert set(paths) >= {
        "/v1/tenants/{tenantId}/documents",
        "/v1/tenants/{tenantId}/documents/{documentId}/versions",
        "/v1/tenants/{tenantId}/documents/{documentId}/versions/{versionNumber}/publish",
        "/v1/tenants/{tenantId}/documents/{documentId}",
        "/v1/tenants/{tenantId}/index-tasks/{taskId}",
        "/healthz",
        "/readyz",
        "/metrics",
    }
    publish = paths[
        "/v1/tenants/{tenantId}/documents/{documentId}/versions/{versionNumber}/publish"
    ]
    assert set(publish["post"]["responses"]) >= {"202", "401", "403", "404", "409", "422"}
    assert "application/problem+json" in publish["post"]["responses"]["409"]["content"]
    assert "TenantApiKey" in schema["components"]["securitySchemes"]
    request = schema["components"]["schemas"]["PublishRequest"]
    assert request["additionalProperties"] is False
    assert set(request["required"]) == {"revision", "acl"}


_TENANT_TABLES = ("document", "document_version", "document_acl", "index_task", "tenant_api_key")


def test_every_query_on_tenant_data_is_scoped_by_tenant() -> None:
    for name, sql in QUERIES.items():
        if not re.search(r"\b(" + "|".join(_TENANT_TABLES) + r")\b", sql):
            continue
        statement = "\n".join(
            line for line in sql.splitlines() if not line.strip().startswith("--")
        )
        if statement.lstrip().upper().startswith("INSERT"):
            # Inserts carry the tenant id as a column value; an INSERT ... SELECT reads none.
            assert "tenant_id" in sql, name
            continue
        assert re.search(r"WHERE\s+(\w+\.)?tenant_id = \$1", statement), (
            f"query {name} does not filter on the tenant id first"
        )
