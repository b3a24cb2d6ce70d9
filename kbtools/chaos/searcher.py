"""The searcher: queries all along the run, as principals inside and outside the readers
of the documents, and as one tenant on another's path; keeps every answer for the checker.

Some searches follow a document's status, as a client waiting for its own publish does:
they pass the status's `searchToken` in `after` (docs/scaling.md#read-your-switch), so that
whichever server answers (the primary or the run's replica) must show that document at the
status's `searchVersion` or a later one."""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from kbtools.chaos.load import GROUPS, OUTSIDER, WORDS, Published
from kbtools.chaos.topology import ChaosStack
from kbtools.demo.client import Tenant

TOKEN_SHARE = 0.25  # of the searches, those that follow a document's status with its token


@dataclass(frozen=True)
class Hit:
    document_id: str
    version_number: int
    chunk_id: str
    text: str = ""


@dataclass(frozen=True)
class Promise:
    """What a status promised the search that passed its token: this document at this
    version or a later one."""

    document_id: str
    version_number: int


@dataclass(frozen=True)
class Answer:
    tenant_id: str  # whose key asked
    path_tenant: str  # whose index it asked
    principals: tuple[str, ...]
    status: int
    hits: tuple[Hit, ...]
    generation_id: int | None
    promise: Promise | None = None


@dataclass
class SearchRecord:
    answers: list[Answer] = field(default_factory=list)
    failed: int = 0  # no answer at all (the API down, a connection refused)


class Searcher:
    def __init__(
        self,
        stack: ChaosStack,
        seed: int,
        stop: threading.Event,
        published: list[Published] | None = None,
    ) -> None:
        self.stack = stack
        self.rng = random.Random(seed * 104729 + 3)
        self.stop = stop
        self.published = published if published is not None else []
        self.record = SearchRecord()
        self.http = httpx.Client(base_url=stack.api_url, timeout=10)

    def run(self) -> None:
        tenants = list(self.stack.tenants.values())
        principal_sets = [[g] for g in GROUPS] + [[OUTSIDER], list(GROUPS)]
        while not self.stop.is_set():
            tenant = self.rng.choice(tenants)
            path_tenant = tenant.tenant_id
            if self.rng.random() < 0.05:
                path_tenant = self.rng.choice(tenants).tenant_id
            principals = self.rng.choice(principal_sets)
            query = " ".join(self.rng.sample(WORDS, 2))
            body: dict[str, Any] = {"query": query, "topK": 10, "principals": principals}
            promise = None
            if self.published and self.rng.random() < TOKEN_SHARE:
                followed = self.rng.choice(self.published[: len(self.published)])
                tenant = self.stack.tenants[followed.tenant_id]
                path_tenant, principals = tenant.tenant_id, list(GROUPS)
                promise, token = self._status(tenant, followed.document_id)
                body = {"query": query, "topK": 10, "principals": principals}
                if promise is not None:
                    body["after"] = [token]
                    body["filter"] = {"documentIds": [followed.document_id]}
            try:
                answer = self.http.post(
                    f"/v1/tenants/{path_tenant}/search", json=body, headers=tenant.headers
                )
            except httpx.TransportError:
                self.record.failed += 1
                time.sleep(0.2)
                continue
            hits: tuple[Hit, ...] = ()
            generation = None
            if answer.status_code == 200:
                payload = answer.json()
                hits = tuple(
                    Hit(h["documentId"], h["versionNumber"], h["chunkId"], h["text"])
                    for h in payload["results"]
                )
                generation = payload["generation"].get("generationId")
            self.record.answers.append(
                Answer(
                    tenant.tenant_id,
                    path_tenant,
                    tuple(principals),
                    answer.status_code,
                    hits,
                    generation,
                    promise if answer.status_code == 200 else None,
                )
            )
            time.sleep(0.05)

    def _status(self, tenant: Tenant, document_id: str) -> tuple[Promise | None, str]:
        """The document's served version and its token, when a version is served."""
        try:
            status = self.http.get(
                f"/v1/tenants/{tenant.tenant_id}/documents/{document_id}",
                headers=tenant.headers,
            )
        except httpx.TransportError:
            return None, ""
        if status.status_code != 200:
            return None, ""
        payload = status.json()
        version, token = payload.get("searchVersion"), payload.get("searchToken")
        if version is None or not token:
            return None, ""
        return Promise(document_id, int(version)), str(token)
