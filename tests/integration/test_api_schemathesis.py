"""Schemathesis against the committed OpenAPI document: whatever it sends, never a 5xx.

The app runs in uvicorn (in-process thread) over a real, migrated database of this module;
every tenant path uses a real tenant key, and half of the document ids are a real document's,
so generated requests get past authentication and lookups into the publish transaction.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import asyncpg
import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from services.publisher.settings import PublisherSettings
from services.publisher.web.openapi import OPENAPI_PATH
from tests.support.api import ApiTenant, add_tenant, live_publisher
from tests.support.stack import Stack, create_test_database, drop_test_database

pytestmark = pytest.mark.integration

SCHEMA = schemathesis.openapi.from_path(OPENAPI_PATH)


@dataclass(frozen=True)
class LiveApi:
    url: str
    tenant: ApiTenant
    document_id: uuid.UUID


@pytest.fixture(scope="module")
async def live_api(stack: Stack, template_database: str) -> AsyncIterator[LiveApi]:
    name = await create_test_database(stack, template_database)
    database_url = stack.database_url(name)
    try:
        conn = await asyncpg.connect(database_url)
        try:
            tenant = await add_tenant(conn, "fuzz", "standard")
        finally:
            await conn.close()
        publisher_settings = PublisherSettings(
            database_url=database_url, publisher_max_upload_bytes=4096, db_pool_max_size=4
        )
        with live_publisher(publisher_settings) as url:
            async with httpx.AsyncClient(base_url=url) as client:
                created = await client.post(
                    tenant.path("/documents"),
                    files={"file": ("a.txt", b"fuzzing target", "text/plain")},
                    data={"title": "Fuzz"},
                    headers=tenant.headers,
                )
                assert created.status_code == 201, created.text
            yield LiveApi(url, tenant, uuid.UUID(created.json()["documentId"]))
    finally:
        await drop_test_database(stack, name)


@SCHEMA.parametrize()
@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    database=None,
)
def test_no_request_makes_the_server_fail(case: schemathesis.Case[Any], live_api: LiveApi) -> None:
    if "tenantId" in case.path_parameters:
        case.path_parameters["tenantId"] = live_api.tenant.tenant_id
    document_id = case.path_parameters.get("documentId")
    if isinstance(document_id, str) and _is_even_uuid(document_id):
        case.path_parameters["documentId"] = str(live_api.document_id)
        if "versionNumber" in case.path_parameters:
            case.path_parameters["versionNumber"] = 1
    response = case.call(base_url=live_api.url, headers=live_api.tenant.headers)
    case.validate_response(
        response,
        checks=[
            not_a_server_error,
            status_code_conformance,
            content_type_conformance,
            response_schema_conformance,
        ],
    )
    if response.status_code >= 400:
        content_type = response.headers.get("content-type") or [""]
        assert content_type[0] == "application/problem+json", response.text
        assert response.json()["errorCode"]


def _is_even_uuid(value: str) -> bool:
    try:
        return uuid.UUID(value).int % 2 == 0
    except ValueError:
        return False
