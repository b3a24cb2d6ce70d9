"""`kb demo`: DESIGN §1's story told with real processes, real documents and the public API.

It drives the system the way a user would: `kb` commands for set-up, HTTP for documents and
search, signals for the crash. What it prints is what the API answered.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from services.demo.console import Console, Step, StepFailed
from services.demo.processes import DemoProcesses

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
QUESTION = "how long do customers have to return an item"
SUPPORT = "group:support"
MODEL = "all-MiniLM-L6-v2-onnx-int8"
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


def free_port(preferred: int | None = None) -> int:
    if preferred is not None:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", preferred)) != 0:
                return preferred
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Demo:
    def __init__(self, home: Path, console: Console, *, api_port: int = 8080) -> None:
        self.home = home
        self.console = console
        self.processes = DemoProcesses(home)
        self.values = self.processes.state.values
        self.preferred_api_port = api_port
        self.env: dict[str, str] = {}
        self.http = httpx.Client(timeout=30)

    # --- plumbing ---------------------------------------------------------------------------

    def kb(self, *args: str, env: dict[str, str] | None = None) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "services.cli", *args],
            env=env or self.env,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"kb {' '.join(args)} exited {done.returncode}: {done.stderr[-800:]}"
            )
        return done.stdout

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.values['api_port']}"

    @property
    def provider(self) -> str:
        return f"http://127.0.0.1:{self.values['provider_port']}"

    def tenant(self, tenant_id: str) -> Tenant:
        found = self.values["tenants"][tenant_id]
        return Tenant(tenant_id, found["tier"], found["key"])

    def wait(self, step: Step, what: str, check: Callable[[], Any], timeout: float = 180) -> Any:
        step.wait_for(what)
        deadline = time.monotonic() + timeout
        while True:
            result = check()
            if result:
                step.wait_for("")
                return result
            if time.monotonic() > deadline:
                raise StepFailed(step.title, f"gave up waiting for {what}", step.log)
            time.sleep(0.1)

    def call(self, method: str, path: str, tenant: Tenant, **kwargs: Any) -> httpx.Response:
        return self.http.request(method, f"{self.api}{path}", headers=tenant.headers, **kwargs)

    # --- the API, as a client uses it --------------------------------------------------------

    def upload(
        self,
        tenant: Tenant,
        path: Path,
        title: str,
        document_id: str | None = None,
        content: bytes | None = None,
        media_type: str | None = None,
    ) -> dict[str, Any]:
        body = content if content is not None else path.read_bytes()
        kind = media_type or _TYPES.get(path.suffix, DOCX)
        files = {"file": (path.name, body, kind)}
        if document_id is None:
            answer = self.call(
                "POST",
                f"/v1/tenants/{tenant.tenant_id}/documents",
                tenant,
                files=files,
                data={"title": title},
            )
        else:
            answer = self.call(
                "POST",
                f"/v1/tenants/{tenant.tenant_id}/documents/{document_id}/versions",
                tenant,
                files=files,
            )
        if answer.status_code != 201:
            raise RuntimeError(
                f"upload of {path.name} answered {answer.status_code}: {answer.text}"
            )
        created: dict[str, Any] = answer.json()
        return created

    def publish(
        self, tenant: Tenant, created: dict[str, Any], readers: list[str] | None = None
    ) -> dict[str, Any]:
        path = (
            f"/v1/tenants/{tenant.tenant_id}/documents/{created['documentId']}/versions/"
            f"{created['versionNumber']}/publish"
        )
        answer = self.call(
            "POST",
            path,
            tenant,
            json={"revision": created["revision"], "acl": {"read": readers or [SUPPORT]}},
        )
        if answer.status_code != 202:
            raise RuntimeError(f"publish answered {answer.status_code}: {answer.text}")
        published: dict[str, Any] = answer.json()
        return published

    def document(self, tenant: Tenant, document_id: str) -> dict[str, Any]:
        answer = self.call("GET", f"/v1/tenants/{tenant.tenant_id}/documents/{document_id}", tenant)
        answer.raise_for_status()
        status: dict[str, Any] = answer.json()
        return status

    def task(self, tenant: Tenant, task_id: str) -> dict[str, Any]:
        answer = self.call("GET", f"/v1/tenants/{tenant.tenant_id}/index-tasks/{task_id}", tenant)
        answer.raise_for_status()
        found: dict[str, Any] = answer.json()
        return found

    def search(
        self, tenant: Tenant, principals: list[str], query: str = QUESTION, top_k: int = 5
    ) -> list[dict[str, Any]]:
        answer = self.call(
            "POST",
            f"/v1/tenants/{tenant.tenant_id}/search",
            tenant,
            json={"query": query, "topK": top_k, "principals": principals},
        )
        if answer.status_code != 200:
            raise RuntimeError(f"search answered {answer.status_code}: {answer.text}")
        results: list[dict[str, Any]] = answer.json()["results"]
        return results

    def until_status(
        self, step: Step, tenant: Tenant, document_id: str, wanted: str, timeout: float = 180
    ) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            status = self.document(tenant, document_id)
            return status if status["indexStatus"] == wanted else None

        found: dict[str, Any] = self.wait(step, f"document {wanted}", check, timeout)
        return found

    def show(self, results: list[dict[str, Any]], limit: int = 3) -> None:
        for rank, hit in enumerate(results[:limit], 1):
            heading = " > ".join(hit["headingPath"]) or "(top)"
            text = " ".join(hit["text"].split())
            text = text if len(text) <= 90 else text[:89] + "…"
            self.console.say(
                f"    {rank}. {hit['title']} v{hit['versionNumber']} > {heading}  "
                f"score {hit['score']:.4f}\n       “{text}”"
            )

    # --- the story --------------------------------------------------------------------------

    def run(self) -> int:
        say = self.console.say
        say("kb demo: DESIGN §1 — from published to searchable, reliably\n")
        try:
            self.bring_up()
            refund = self.story()
        except StepFailed as error:
            self.console.failed(error)
            self.console.say(f"logs: {self.home}")
            return 1
        self.console.summary()
        acme = self.tenant("acme")
        say()
        say(f"operator page  {self.api}/ui   (operator key: {self.values['operator_key']})")
        say(f"API            {self.api}/v1/tenants/acme   (tenant acme, key: {acme.key})")
        say("try:")
        say(f"  curl -s -H 'Authorization: Bearer {acme.key}' \\")
        say("       -H 'content-type: application/json' \\")
        say(f'       -d \'{{"query": "{QUESTION}", "topK": 3, "principals": ["{SUPPORT}"]}}\' \\')
        say(f"       {self.api}/v1/tenants/acme/search")
        say(f"refund policy document: {refund}")
        say(f"logs: {self.home}/*.log · stop everything: kb demo --stop && kb dev down")
        return 0

    def bring_up(self) -> None:
        with self.console.step("PostgreSQL + pgvector and Kafka") as step:
            lines = self.kb("dev", "up", env=dict(os.environ))
            base = {k: v for k, v in os.environ.items() if not k.startswith("KB_")}
            for line in lines.splitlines():
                name, _, value = line.partition("=")
                if name in ("DATABASE_URL", "KAFKA_BOOTSTRAP_SERVERS"):
                    base[name] = value
            base["KB_LOG_FORMAT"] = "json"
            self.env = base
            self.kb("migrate")
            step.done(f"running and migrated ({base['DATABASE_URL']})")

        with self.console.step("tenants and an operator key") as step:
            tenants = self.values.setdefault("tenants", {})
            for tenant_id, tier in (("acme", "standard"), ("globex", "premium")):
                if tenant_id not in tenants:
                    key = self.kb("tenants", "create", tenant_id, "--tier", tier).strip()
                    tenants[tenant_id] = {"tier": tier, "key": key.removeprefix("KB_API_KEY=")}
            if "operator_key" not in self.values:
                name = f"demo-{uuid.uuid4().hex[:6]}"
                key = self.kb("operators", "create", name).strip()
                self.values["operator_key"] = key.removeprefix("KB_OPERATOR_KEY=")
            self.processes.save()
            step.done("acme (standard tier), globex (premium tier)")

        with self.console.step("API, relays, indexers and the embedding provider") as step:
            self.start_services(step)
            step.done(f"API on {self.api}, 2 relays, one indexer pool per tier")

    def start_services(self, step: Step) -> None:
        procs = self.processes
        if procs.running("api") is None:
            self.values["api_port"] = free_port(self.preferred_api_port)
        if procs.running("provider") is None:
            self.values["provider_port"] = free_port()
        self.processes.save()
        provider_env = dict(self.env)
        step.log = str(self.home / "provider.log")
        procs.start(
            "provider",
            ["services.demo.provider", "--port", str(self.values["provider_port"])],
            provider_env,
        )
        self.wait(step, "the embedding provider", lambda: self._up(f"{self.provider}/healthz"), 120)
        step.log = str(self.home / "api.log")
        procs.start(
            "api", ["services.cli", "serve", "--port", str(self.values["api_port"])], self.env
        )
        for n in (1, 2):
            procs.start(
                f"relay-{n}",
                ["services.cli", "relay", "run"],
                {**self.env, "KB_RELAY_TOPIC_TIERS": '["standard","premium"]'},
            )
        for tier in ("standard", "premium"):
            self.start_indexer(tier)
        self.wait(step, "the API", lambda: self._up(f"{self.api}/readyz"), 120)

    def indexer_env(self) -> dict[str, str]:
        return {
            **self.env,
            "KB_EMBEDDING_PROVIDER": "openai",
            "KB_EMBEDDING_BASE_URL": f"{self.provider}/v1",
            "KB_EMBEDDING_MODEL": MODEL,
            "KB_EMBEDDING_DIMENSIONS": "384",
            # Short timers so the story's retries and takeover happen in seconds.
            "KB_INDEXER_LEASE_SECONDS": "6",
            "KB_INDEXER_POLL_SECONDS": "1",
            "KB_INDEXER_BACKOFF_BASE_SECONDS": "1",
            "KB_INDEXER_BACKOFF_CAP_SECONDS": "2",
            "KB_INDEXER_GRACE_PERIOD_SECONDS": "5",
        }

    def start_indexer(self, tier: str) -> None:
        self.processes.start(
            f"indexer-{tier}",
            ["services.cli", "indexer", "run", "--tier", tier],
            self.indexer_env(),
        )

    def _up(self, url: str) -> bool:
        try:
            return self.http.get(url, timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def story(self) -> str:
        acme, globex = self.tenant("acme"), self.tenant("globex")
        step_ = self.console.step

        with step_("publish a dozen policies (search needs something to rank)") as step:
            step.log = str(self.home / "indexer-standard.log")
            published = []
            for path in sorted((EXAMPLES / "policies").iterdir()):
                title = path.stem.replace("-", " ").capitalize()
                published.append(self.publish(acme, self.upload(acme, path, title)))
            for item in published:
                self.until_status(step, acme, item["documentId"], "SEARCHABLE")
            step.done(f"{len(published)} documents SEARCHABLE (Markdown, text, HTML)")

        with step_("publish refund policy v1 (Markdown)") as step:
            step.log = str(self.home / "indexer-standard.log")
            v1 = self.upload(acme, EXAMPLES / "refund-policy" / "v1.md", "Refund policy")
            refund: str = v1["documentId"]
            task = self.publish(acme, v1)["indexTaskId"]
            self.until_status(step, acme, refund, "SEARCHABLE")
            step.done(f"202 at once with task {task[:8]}…, then SEARCHABLE")

        with step_(f"search “{QUESTION}”") as step:
            hits = self.search(acme, [SUPPORT])
            self.refund_versions(step, hits, refund, {1})
            step.done("answered from v1 (30 days)")
        self.show(hits)

        with step_("provider rate-limits (429) while v2 (DOCX) is published") as step:
            step.log = str(self.home / "indexer-standard.log")
            self.http.post(f"{self.provider}/_control/throttle", json={"seconds": 4})
            v2 = self.upload(
                acme, EXAMPLES / "refund-policy" / "v2.docx", "", refund, media_type=DOCX
            )
            task = self.publish(acme, v2)["indexTaskId"]
            retrying = self.wait(
                step, "the task to back off (RETRY_WAIT)", lambda: self._retrying(acme, task), 60
            )
            status = self.document(acme, refund)
            hits = self.search(acme, [SUPPORT])
            self.refund_versions(step, hits, refund, {1})
            if status["indexStatus"] != "INDEXING" or status["searchVersion"] != 1:
                raise StepFailed(step.title, f"expected INDEXING on v1, got {status}")
            step.done(
                f"{retrying['errorCode']}: task in RETRY_WAIT, document INDEXING, "
                "search still answers from v1 only"
            )

        with step_("throttling ends: v2 becomes searchable") as step:
            step.log = str(self.home / "indexer-standard.log")
            self.until_status(step, acme, refund, "SEARCHABLE", timeout=120)
            hits = self.search(acme, [SUPPORT])
            self.refund_versions(step, hits, refund, {2})
            step.done("SEARCHABLE on v2: search answers from v2 only (45 days)")
        self.show(hits)

        with step_("publish a corrupt PDF as v3") as step:
            step.log = str(self.home / "indexer-standard.log")
            v3 = self.upload(
                acme,
                EXAMPLES / "refund-policy" / "v3.pdf",
                "",
                refund,
                content=b"%PDF-1.7\n%broken: no objects, no xref\n",
                media_type="application/pdf",
            )
            self.publish(acme, v3)
            status = self.until_status(step, acme, refund, "FAILED", timeout=120)
            code = (status.get("failure") or {}).get("errorCode")
            hits = self.search(acme, [SUPPORT])
            self.refund_versions(step, hits, refund, {2})
            step.done(f"FAILED: {code}; search still serves v{status['searchVersion']}")

        with step_("walls: a principal outside the ACL, another tenant's key") as step:
            outside = [h for h in self.search(acme, ["group:sales"]) if h["documentId"] == refund]
            other = self.call(
                "POST",
                "/v1/tenants/acme/search",
                globex,
                json={"query": QUESTION, "topK": 3, "principals": [SUPPORT]},
            )
            if outside or other.status_code != 403:
                raise StepFailed(
                    step.title, f"walls leaked: {len(outside)} hits, {other.status_code}"
                )
            step.done("group:sales sees nothing of it; globex's key on acme answers 403")

        with step_("SIGKILL an indexer in the middle of a task") as step:
            step.log = str(self.home / "indexer-standard.log")
            handbook = self.publish(
                acme,
                self.upload(
                    acme,
                    Path("handbook.md"),
                    "Field operations handbook",
                    content=handbook_text().encode(),
                    media_type=MARKDOWN,
                ),
            )
            task_id = handbook["indexTaskId"]
            running = self.wait(
                step, "the task to start", lambda: self._task_in(acme, task_id, {"RUNNING"}), 120
            )
            victim = self.processes.running("indexer-standard")
            self.processes.kill("indexer-standard")
            self.start_indexer("standard")
            done = self.wait(
                step,
                "another indexer to take the task over",
                lambda: self._task_in(acme, task_id, {"SUCCEEDED", "DEAD"}),
                240,
            )
            if done["status"] != "SUCCEEDED" or done["attempts"] <= running["attempts"]:
                raise StepFailed(step.title, f"expected a takeover, got {done}")
            step.done(
                f"killed pid {victim.pid if victim else '?'} on attempt "
                f"{running['attempts']}; taken over, SUCCEEDED on attempt "
                f"{done['attempts']}"
            )
        return refund

    def refund_versions(
        self, step: Step, hits: list[dict[str, Any]], refund: str, allowed: set[int]
    ) -> None:
        versions = {h["versionNumber"] for h in hits if h["documentId"] == refund}
        if not versions or not versions <= allowed:
            raise StepFailed(
                step.title, f"refund policy answered from versions {versions}, expected {allowed}"
            )

    def _retrying(self, tenant: Tenant, task_id: str) -> dict[str, Any] | None:
        task = self.task(tenant, task_id)
        return task if task["status"] == "RETRY_WAIT" else None

    def _task_in(self, tenant: Tenant, task_id: str, states: set[str]) -> dict[str, Any] | None:
        task = self.task(tenant, task_id)
        return task if task["status"] in states else None


def handbook_text(sections: int = 240) -> str:
    """A long document with distinct sections: long enough to be killed in the middle of."""
    sites = ["Lisbon", "Oslo", "Graz", "Tartu", "Lyon", "Cork", "Turku", "Brno"]
    parts = ["# Field operations handbook\n"]
    for n in range(1, sections + 1):
        site = sites[n % len(sites)]
        parts.append(
            f"## Procedure {n}: {site} depot, bay {n % 17 + 1}\n\n"
            f"Before shift {n}, the lead at the {site} depot checks bay {n % 17 + 1}, signs "
            f"sheet {1000 + n} and confirms that pallet rack {n * 7 % 113} holds no more than "
            f"{200 + n * 3} kilograms. Deviations go to the site manager within {n % 5 + 1} "
            f"hours, with photos, and are reviewed at the weekly meeting number {n}.\n"
        )
    return "\n".join(parts)
