"""The public HTTP API as the demo's client uses it: upload, publish, status, tasks, search."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

MARKDOWN = "text/markdown"
DOCX = "application/vnd.openxmlformats-officedocument.wordprocessingml.document"
_TYPES = {".md": MARKDOWN, ".txt": "text/plain", ".html": "text/html", ".pdf": "application/pdf"}


@dataclass(frozen=True)
class Tenant:
    tenant_id: str
    tier: str
    key: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}


class ApiClient:
    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.http = httpx.Client(timeout=30)

    def healthy(self, url: str) -> bool:
        try:
            return self.http.get(url, timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def call(self, method: str, path: str, tenant: Tenant, **kwargs: Any) -> httpx.Response:
        return self.http.request(method, f"{self.base_url}{path}", headers=tenant.headers, **kwargs)

    def _json(self, answer: httpx.Response, expected: int, what: str) -> dict[str, Any]:
        if answer.status_code != expected:
            raise RuntimeError(f"{what} answered {answer.status_code}: {answer.text[:500]}")
        body: dict[str, Any] = answer.json()
        return body

    def upload(
        self,
        tenant: Tenant,
        name: str,
        content: bytes,
        *,
        title: str = "",
        document_id: str | None = None,
        media_type: str | None = None,
    ) -> dict[str, Any]:
        """A new document (with ``title``) or a new version of ``document_id``."""
        kind = media_type or _TYPES.get(Path(name).suffix, DOCX)
        files = {"file": (name, content, kind)}
        documents = f"/v1/tenants/{tenant.tenant_id}/documents"
        if document_id is None:
            answer = self.call("POST", documents, tenant, files=files, data={"title": title})
        else:
            answer = self.call("POST", f"{documents}/{document_id}/versions", tenant, files=files)
        return self._json(answer, 201, f"upload of {name}")

    def upload_file(self, tenant: Tenant, path: Path, **kwargs: Any) -> dict[str, Any]:
        return self.upload(tenant, path.name, path.read_bytes(), **kwargs)

    def publish(
        self, tenant: Tenant, created: dict[str, Any], readers: list[str]
    ) -> dict[str, Any]:
        path = (
            f"/v1/tenants/{tenant.tenant_id}/documents/{created['documentId']}/versions/"
            f"{created['versionNumber']}/publish"
        )
        body = {"revision": created["revision"], "acl": {"read": readers}}
        return self._json(self.call("POST", path, tenant, json=body), 202, "publish")

    def document(self, tenant: Tenant, document_id: str) -> dict[str, Any]:
        path = f"/v1/tenants/{tenant.tenant_id}/documents/{document_id}"
        return self._json(self.call("GET", path, tenant), 200, "document status")

    def task(self, tenant: Tenant, task_id: str) -> dict[str, Any]:
        path = f"/v1/tenants/{tenant.tenant_id}/index-tasks/{task_id}"
        return self._json(self.call("GET", path, tenant), 200, "index task")

    def search_as(
        self, tenant: Tenant, path_tenant: str, query: str, principals: list[str], top_k: int = 5
    ) -> httpx.Response:
        body = {"query": query, "topK": top_k, "principals": principals}
        return self.call("POST", f"/v1/tenants/{path_tenant}/search", tenant, json=body)

    def search(
        self, tenant: Tenant, query: str, principals: list[str], top_k: int = 5
    ) -> list[dict[str, Any]]:
        answer = self.search_as(tenant, tenant.tenant_id, query, principals, top_k)
        results: list[dict[str, Any]] = self._json(answer, 200, "search")["results"]
        return results
