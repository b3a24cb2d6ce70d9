"""The searcher: queries all along the run, as principals inside and outside the readers
of the documents, and as one tenant on another's path; keeps every answer for the checker.

Some searches follow a document's status, as a client waiting for its own publish does:
they pass the status's `searchToken` in `after` (docs/scaling.md#read-your-switch), so that
whichever server answers (the primary or the run's replica) must show that document at the
status's `searchVersion` or a later one.

Others check the deletes (kbtools/chaos/checks/removals.py): some pass a delete's own token, some
the token of a status that said `DELETED`, each filtered to that document, which must then be
absent; some go to the run's primary-only API. Before each search the replica's replay
position last read is noted: a delete it had passed must show in that search, token or not."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import httpx

from kbtools.chaos.rig.topology import ChaosStack
from kbtools.chaos.traffic.load import GROUPS, OUTSIDER, WORDS, Published, Removal, lsn_of
from kbtools.demo.client import Tenant
from services.runtime.pg.sql import queries_beside

QUERIES = queries_beside(__file__, "traffic.sql")
TOKEN_SHARE = 0.25  # of the searches, those that follow a document's status with its token
DELETED_SHARE = 0.1  # those that pass a delete's token, filtered to its document
PRIMARY_SHARE = 0.1  # those sent to the primary-only API


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
    sent_at: float = 0.0  # monotonic
    replayed: int | None = None  # the replica's replay position last read before sending
    primary: bool = False  # sent to the primary-only API
    absent: str | None = None  # a document it must not hold: its delete's token was passed


@dataclass(frozen=True)
class Followed:
    """What a document's status told a client following it."""

    promise: Promise | None = None
    token: str = ""
    deleted: bool = False


class ReplayWatch:
    """The replica's replay position, read every 0.2 s on a connection of its own: a value
    read is a lower bound of the position at any later moment (replay only moves forward;
    the run never restarts the replica)."""

    def __init__(self, url: str, stop: threading.Event) -> None:
        self.url = url
        self.stop = stop
        self.latest: int | None = None

    def run(self) -> None:
        asyncio.run(self._poll())

    async def _poll(self) -> None:
        conn: asyncpg.Connection[Any] | None = None
        while not self.stop.is_set():
            try:
                if conn is None:
                    conn = await asyncpg.connect(self.url, timeout=2)
                position = await conn.fetchval(QUERIES["replay_position"])
                if position:
                    self.latest = lsn_of(position)
            except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError):
                if conn is not None:
                    conn.terminate()
                conn = None
            await asyncio.sleep(0.2)
        if conn is not None:
            await conn.close()


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
        removed: list[Removal] | None = None,
        replay: ReplayWatch | None = None,
    ) -> None:
        self.stack = stack
        self.rng = random.Random(seed * 104729 + 3)
        self.stop = stop
        self.published = published if published is not None else []
        self.removed = removed if removed is not None else []
        self.replay = replay
        self.record = SearchRecord()
        self.http = httpx.Client(base_url=stack.api_url, timeout=10)
        self.primary_http = httpx.Client(base_url=stack.primary_api_url, timeout=10)

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
            promise, absent, primary = None, None, False
            draw = self.rng.random()
            if self.published and draw < TOKEN_SHARE:
                followed = self.rng.choice(self.published[: len(self.published)])
                tenant = self.stack.tenants[followed.tenant_id]
                path_tenant, principals = tenant.tenant_id, list(GROUPS)
                status = self._status(tenant, followed.document_id)
                body = {"query": query, "topK": 10, "principals": principals}
                if status.token:
                    body["after"] = [status.token]
                    body["filter"] = {"documentIds": [followed.document_id]}
                    promise = status.promise
                    absent = followed.document_id if status.deleted else None
            elif self.removed and draw < TOKEN_SHARE + DELETED_SHARE:
                removal = self.rng.choice(self.removed[: len(self.removed)])
                tenant = self.stack.tenants[removal.tenant_id]
                path_tenant, principals = tenant.tenant_id, list(GROUPS)
                body = {
                    "query": query,
                    "topK": 10,
                    "principals": principals,
                    "after": [removal.token],
                    "filter": {"documentIds": [removal.document_id]},
                }
                absent = removal.document_id
            elif draw > 1 - PRIMARY_SHARE:
                primary = True
            # Read before sending: the replica had replayed at least this much by then.
            replayed = self.replay.latest if self.replay is not None else None
            sent_at = time.monotonic()
            try:
                answer = (self.primary_http if primary else self.http).post(
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
                    sent_at,
                    replayed,
                    primary,
                    absent,
                )
            )
            time.sleep(0.05)

    def _status(self, tenant: Tenant, document_id: str) -> Followed:
        """The document's served version and its token, when a version is served; a
        deleted document's token, which no search passing it may answer the document to."""
        try:
            status = self.http.get(
                f"/v1/tenants/{tenant.tenant_id}/documents/{document_id}",
                headers=tenant.headers,
            )
        except httpx.TransportError:
            return Followed()
        if status.status_code != 200:
            return Followed()
        payload = status.json()
        version, token = payload.get("searchVersion"), payload.get("searchToken")
        if not token:
            return Followed()
        if payload.get("indexStatus") == "DELETED":
            return Followed(token=str(token), deleted=True)
        if version is None:
            return Followed()
        return Followed(Promise(document_id, int(version)), str(token))
