"""The synchronous client."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from types import TracebackType
from typing import Self, TypeVar

import httpx
from pydantic import BaseModel

from kb_client._core import (
    ApiKey,
    BulkEntry,
    Call,
    FileInput,
    Published,
    RetryPolicy,
    final_error,
    is_searchable,
    parse,
    pause_for,
    poll_delay,
    title_of,
)
from kb_client._requests import ClientBase, log
from kb_client.errors import DeadlineExceeded, ProblemError
from kb_client.models import (
    BulkResponse,
    DeleteResponse,
    DocumentStatusResponse,
    EraseResponse,
    IndexTaskResponse,
    IngestKeyList,
    IngestKeyResponse,
    PublishResponse,
    SearchMode,
    SearchResponse,
    VersionCreatedResponse,
)

M = TypeVar("M", bound=BaseModel)


class KbClient(ClientBase):
    """One tenant's API. ``KbClient(url, api_key=key)``; the tenant is read from the key.

    Searches pass the newest ``searchToken`` this client was handed (by a status read or a
    wait) as ``after``: after ``publish_and_wait`` a search sees the version, whichever
    replica answers it.
    """

    def __init__(
        self,
        base_url: str,
        api_key: str | ApiKey,
        *,
        tenant: str | None = None,
        timeout: float = 30.0,
        retry: RetryPolicy | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        super().__init__(base_url, api_key, tenant=tenant, retry=retry)
        self._http = httpx.Client(
            base_url=self.base_url, auth=self._auth(), timeout=timeout, transport=transport
        )

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    # --- the endpoints ----------------------------------------------------------------------

    def create_document(
        self,
        file: FileInput,
        *,
        title: str,
        filename: str | None = None,
        media_type: str | None = None,
    ) -> VersionCreatedResponse:
        call = self._create_document(file, title, filename, media_type)
        return self._send(call, VersionCreatedResponse)

    def add_version(
        self,
        document_id: uuid.UUID | str,
        file: FileInput,
        *,
        filename: str | None = None,
        media_type: str | None = None,
    ) -> VersionCreatedResponse:
        call = self._add_version(document_id, file, filename, media_type)
        return self._send(call, VersionCreatedResponse)

    def publish(
        self,
        document_id: uuid.UUID | str,
        version: int,
        *,
        revision: int,
        read: Sequence[str],
    ) -> PublishResponse:
        return self._send(self._publish(document_id, version, revision, read), PublishResponse)

    def publish_many(self, items: Sequence[BulkEntry]) -> BulkResponse:
        return self._send(self._publish_many(items), BulkResponse)

    def document_status(self, document_id: uuid.UUID | str) -> DocumentStatusResponse:
        status = self._send(self._status(document_id), DocumentStatusResponse)
        self.tokens.remember(status.search_token)
        return status

    def delete_document(self, document_id: uuid.UUID | str, *, revision: int) -> DeleteResponse:
        """Take the document out of search, for good (its revision as last read). A repeat
        answers what the delete did. The answer's ``searchToken`` is remembered: this
        client's next searches never return the document, on any replica."""
        deleted = self._send(self._delete(document_id, revision), DeleteResponse)
        self.tokens.remember(deleted.search_token)
        return deleted

    def erase_document(self, document_id: uuid.UUID | str) -> EraseResponse:
        """Erase the document's content for good (an ``admin`` key only: 403 otherwise); a
        live document is deleted first. A repeat answers what the erase did, or finishes
        one that stopped halfway. The answer's ``searchToken`` is remembered, as a
        delete's."""
        erased = self._send(self._erase(document_id), EraseResponse)
        self.tokens.remember(erased.search_token)
        return erased

    def add_ingest_key(self, key_id: str, public_key: str) -> IngestKeyResponse:
        """Register an Ed25519 public key (base64 of its 32 bytes) the tenant's producers
        sign ingest commands with (an ``admin`` key only)."""
        return self._send(self._add_ingest_key(key_id, public_key), IngestKeyResponse)

    def list_ingest_keys(self) -> IngestKeyList:
        """The tenant's ingest keys, revoked ones included, oldest first (an ``admin`` key
        only)."""
        return self._send(self._list_ingest_keys(), IngestKeyList)

    def revoke_ingest_key(self, key_id: str) -> IngestKeyResponse:
        """Revoke an ingest key at once (an ``admin`` key only)."""
        return self._send(self._revoke_ingest_key(key_id), IngestKeyResponse)

    def index_task(self, task_id: uuid.UUID | str) -> IndexTaskResponse:
        return self._send(self._index_task(task_id), IndexTaskResponse)

    def search(
        self,
        query: str,
        *,
        principals: Sequence[str] | None = None,
        principal_token: str | None = None,
        mode: SearchMode | str = SearchMode.HYBRID,
        top_k: int = 10,
        document_ids: Sequence[uuid.UUID | str] | None = None,
        heading_prefix: Sequence[str] | None = None,
        after: Sequence[str] | None = None,
    ) -> SearchResponse:
        call = self._search(
            query,
            principals=principals,
            principal_token=principal_token,
            mode=mode,
            top_k=top_k,
            document_ids=document_ids,
            heading_prefix=heading_prefix,
            after=after,
        )
        return self._send(call, SearchResponse)

    # --- waiting ----------------------------------------------------------------------------

    def wait_searchable(
        self, document_id: uuid.UUID | str, version: int, timeout: float = 120.0
    ) -> str | None:
        """Until ``version`` (or a later one) is what search serves: its ``searchToken``,
        remembered for this client's searches. Raises ``IndexingFailed`` when it failed,
        ``DocumentDeleted`` when the document is deleted, ``DeadlineExceeded`` after
        ``timeout`` seconds."""
        return self._searchable(document_id, version, timeout).search_token

    def _searchable(
        self, document_id: uuid.UUID | str, version: int, timeout: float
    ) -> DocumentStatusResponse:
        deadline = time.monotonic() + timeout
        attempt = 0
        while True:
            status = self.document_status(document_id)
            if is_searchable(status, version):
                return status
            pause = poll_delay(attempt)
            if time.monotonic() + pause > deadline:
                raise DeadlineExceeded(
                    f"version {version} of {document_id} not searchable within {timeout:g} s"
                    f" (status {status.index_status.value})"
                )
            time.sleep(pause)
            attempt += 1

    def publish_and_wait(
        self,
        document_id: uuid.UUID | str,
        version: int,
        *,
        revision: int,
        read: Sequence[str],
        timeout: float = 120.0,
    ) -> Published:
        published = self.publish(document_id, version, revision=revision, read=read)
        status = self._searchable(document_id, version, timeout)
        return Published(
            published.document_id, version, published.revision, status.search_token, status
        )

    def publish_file(
        self,
        file: FileInput,
        *,
        read: Sequence[str],
        title: str | None = None,
        document_id: uuid.UUID | str | None = None,
        filename: str | None = None,
        media_type: str | None = None,
        timeout: float = 120.0,
    ) -> Published:
        """Upload ``file`` (a new document titled ``title``, by default its file name, or a
        new version of ``document_id``), publish it with ``read`` and wait until searchable."""
        if document_id is None:
            name = title or title_of(file, filename)
            created = self.create_document(
                file, title=name, filename=filename, media_type=media_type
            )
        else:
            created = self.add_version(document_id, file, filename=filename, media_type=media_type)
        return self.publish_and_wait(
            created.document_id,
            created.version_number,
            revision=created.revision,
            read=read,
            timeout=timeout,
        )

    # --- sending ----------------------------------------------------------------------------

    def _send(self, call: Call, model: type[M]) -> M:
        started = time.monotonic()
        attempt = 0
        while True:
            try:
                response = self._http.request(
                    call.method,
                    call.path,
                    params=call.params,
                    json=call.json,
                    data=call.data,
                    files=call.files,
                )
                return parse(response, model)
            except (ProblemError, httpx.TransportError) as error:
                pause = pause_for(self.retry, call, error, attempt, started)
                if pause is None:
                    raise final_error(error, self.base_url) from None
            log.debug(
                "kb_client.retry",
                extra={"method": call.method, "attempt": attempt + 1, "pause": pause},
            )
            time.sleep(pause)
            attempt += 1
