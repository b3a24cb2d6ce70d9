"""Each tenant endpoint as a ``Call`` (what to send, how it may be retried): the sync and the
async client send the same calls."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Generator, Sequence

import httpx

from kb_client._core import (
    ApiKey,
    BulkEntry,
    BulkItem,
    Call,
    FileInput,
    Retry,
    RetryPolicy,
    TokenMemory,
    file_part,
    tenant_path,
)
from kb_client.models import (
    IngestKeyRequest,
    PublishRequest,
    ReadAcl,
    SearchBody,
    SearchFilterBody,
    SearchMode,
)

log = logging.getLogger("kb_client")

# operationId in the server's OpenAPI document -> the client method that calls it
# (tests/client/test_models_match_openapi.py checks every tenant operation has one).
OPERATIONS = {
    "create_document": "create_document",
    "add_version": "add_version",
    "publish_version": "publish",
    "publish_many": "publish_many",
    "document_status": "document_status",
    "delete_document": "delete_document",
    "erase_document": "erase_document",
    "add_ingest_key": "add_ingest_key",
    "list_ingest_keys": "list_ingest_keys",
    "revoke_ingest_key": "revoke_ingest_key",
    "index_task": "index_task",
    "search": "search",
}


class ClientBase:
    def __init__(
        self,
        base_url: str,
        api_key: str | ApiKey,
        *,
        tenant: str | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        self._key = api_key if isinstance(api_key, ApiKey) else ApiKey(api_key)
        found = tenant or self._key.tenant
        if not found:
            raise ValueError("name the tenant: the API key does not look like kb.<tenant>.<...>")
        self.tenant = found
        self.base_url = base_url.rstrip("/")
        self.retry = retry or RetryPolicy()
        self.tokens = TokenMemory()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(base_url={self.base_url!r}, tenant={self.tenant!r})"

    def _auth(self) -> httpx.Auth:
        return _BearerAuth(self._key)

    def _path(self, rest: str) -> str:
        return tenant_path(self.tenant, rest)

    def _create_document(
        self, file: FileInput, title: str, filename: str | None, media_type: str | None
    ) -> Call:
        return Call(
            "POST",
            self._path("/documents"),
            Retry.REFUSED_ONLY,
            data={"title": title},
            files=[("file", file_part(file, filename, media_type))],
        )

    def _add_version(
        self,
        document_id: uuid.UUID | str,
        file: FileInput,
        filename: str | None,
        media_type: str | None,
    ) -> Call:
        return Call(
            "POST",
            self._path(f"/documents/{_id(document_id)}/versions"),
            Retry.REFUSED_ONLY,
            files=[("file", file_part(file, filename, media_type))],
        )

    def _publish(
        self, document_id: uuid.UUID | str, version: int, revision: int, read: Sequence[str]
    ) -> Call:
        body = PublishRequest(revision=revision, acl=ReadAcl(read=list(read)))
        return Call(
            "POST",
            self._path(f"/documents/{_id(document_id)}/versions/{int(version)}/publish"),
            Retry.SAFE,
            json=body.model_dump(mode="json", by_alias=True),
        )

    def _publish_many(self, items: Sequence[BulkEntry]) -> Call:
        # One file part per upload, in the items' order; a delete or an erase has none.
        uploads = [i for i in items if isinstance(i, BulkItem)]
        return Call(
            "POST",
            self._path("/documents/bulk"),
            Retry.REFUSED_ONLY,
            data={"items": json.dumps([item.entry() for item in items])},
            files=[("file", file_part(i.file, i.filename, i.media_type)) for i in uploads],
        )

    def _delete(self, document_id: uuid.UUID | str, revision: int) -> Call:
        # The revision is a query parameter: a DELETE's body has no defined meaning.
        return Call(
            "DELETE",
            self._path(f"/documents/{_id(document_id)}"),
            Retry.SAFE,
            params={"revision": str(int(revision))},
        )

    def _erase(self, document_id: uuid.UUID | str) -> Call:
        # Safe to send again: a repeat answers what the erase did, or finishes it.
        return Call("POST", self._path(f"/documents/{_id(document_id)}/erase"), Retry.SAFE)

    def _add_ingest_key(self, key_id: str, public_key: str) -> Call:
        # Not sent again after a lost answer: the repeat would answer 409 for the key added.
        body = IngestKeyRequest(key_id=key_id, public_key=public_key)
        return Call(
            "POST",
            self._path("/ingest-keys"),
            Retry.REFUSED_ONLY,
            json=body.model_dump(mode="json", by_alias=True),
        )

    def _list_ingest_keys(self) -> Call:
        return Call("GET", self._path("/ingest-keys"), Retry.SAFE)

    def _revoke_ingest_key(self, key_id: str) -> Call:
        return Call("DELETE", self._path(f"/ingest-keys/{key_id}"), Retry.REFUSED_ONLY)

    def _status(self, document_id: uuid.UUID | str) -> Call:
        return Call("GET", self._path(f"/documents/{_id(document_id)}"), Retry.SAFE)

    def _index_task(self, task_id: uuid.UUID | str) -> Call:
        return Call("GET", self._path(f"/index-tasks/{_id(task_id)}"), Retry.SAFE)

    def _search(
        self,
        query: str,
        *,
        principals: Sequence[str] | None,
        principal_token: str | None,
        mode: SearchMode | str,
        top_k: int,
        document_ids: Sequence[uuid.UUID | str] | None,
        heading_prefix: Sequence[str] | None,
        after: Sequence[str] | None,
    ) -> Call:
        search_filter = None
        if document_ids is not None or heading_prefix is not None:
            search_filter = SearchFilterBody(
                document_ids=[uuid.UUID(str(d)) for d in document_ids]
                if document_ids is not None
                else None,
                heading_prefix=list(heading_prefix) if heading_prefix is not None else None,
            )
        body = SearchBody(
            query=query,
            top_k=top_k,
            principals=list(principals) if principals is not None else None,
            principal_token=principal_token,
            mode=SearchMode(mode),
            filter=search_filter,
            after=self.tokens.after(after),
        )
        return Call(
            "POST",
            self._path("/search"),
            Retry.SAFE,
            json=body.model_dump(mode="json", by_alias=True, exclude_none=True),
        )


def _id(value: uuid.UUID | str) -> str:
    # Validated here so that a stray '/' or '..' can never change the path sent.
    return str(uuid.UUID(str(value)))


class _BearerAuth(httpx.Auth):
    """Adds the key to each request at the last moment; the key lives nowhere else."""

    def __init__(self, key: ApiKey) -> None:
        self._key = key

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        request.headers["Authorization"] = f"Bearer {self._key.secret()}"
        yield request

    def __repr__(self) -> str:
        return "BearerAuth(***)"
