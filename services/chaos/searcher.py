"""The searcher: queries all along the run, as principals inside and outside the readers
of the documents, and as one tenant on another's path; keeps every answer for the checker."""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field

import httpx

from services.chaos.load import GROUPS, OUTSIDER, WORDS
from services.chaos.topology import ChaosStack


@dataclass(frozen=True)
class Hit:
    document_id: str
    version_number: int
    chunk_id: str


@dataclass(frozen=True)
class Answer:
    tenant_id: str  # whose key asked
    path_tenant: str  # whose index it asked
    principals: tuple[str, ...]
    status: int
    hits: tuple[Hit, ...]
    generation_id: int | None


@dataclass
class SearchRecord:
    answers: list[Answer] = field(default_factory=list)
    failed: int = 0  # no answer at all (the API down, a connection refused)


class Searcher:
    def __init__(self, stack: ChaosStack, seed: int, stop: threading.Event) -> None:
        self.stack = stack
        self.rng = random.Random(seed * 104729 + 3)
        self.stop = stop
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
            body = {"query": query, "topK": 10, "principals": principals}
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
                    Hit(h["documentId"], h["versionNumber"], h["chunkId"])
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
                )
            )
            time.sleep(0.05)
