"""`kb demo`: the story of docs/architecture.md#the-story, told with real processes, real
documents and the public API.

It drives the system the way a user would: `kb` commands for set-up, HTTP for documents and
search, a signal for the crash. What it prints is what the API answered.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kbtools.demo.client import DOCX, MARKDOWN, ApiClient, Tenant
from kbtools.demo.console import Console, Step, StepFailed
from kbtools.demo.documents import handbook_text, refund_policy_docx
from kbtools.demo.stack import DemoStack

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
QUESTION = "how long do customers have to return an item"
SUPPORT = "group:support"
CORRUPT_PDF = b"%PDF-1.7\n%broken: no objects, no cross-reference table\n"


class Demo:
    def __init__(self, home: Path, console: Console, *, api_port: int = 8080) -> None:
        self.home = home
        self.console = console
        self.stack = DemoStack(home, api_port=api_port)
        self.api: ApiClient | None = None
        # Stamped into the documents that must reach the provider (see documents.py).
        self.edition = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")

    def run(self) -> int:
        say = self.console.say
        say("kb demo: from published to searchable, reliably\n")
        try:
            self.api = self.stack.bring_up(self.console)
            refund = self.story(self.api)
        except StepFailed as error:
            self.console.failed(error)
            say(f"logs: {self.home}")
            return 1
        self.console.summary()
        self.epilogue(refund)
        return 0

    def epilogue(self, refund: str) -> None:
        say, stack = self.console.say, self.stack
        acme = stack.tenant("acme")
        base = stack.api_url
        body = f'{{"query": "{QUESTION}", "topK": 3, "principals": ["{SUPPORT}"]}}'
        say()
        say(f"operator page  {base}/ui   (operator key: {stack.values['operator_key']})")
        tenant = acme.tenant_id
        say(f"API            {base}/v1/tenants/{tenant}   (tenant {tenant}, key: {acme.key})")
        say(f"refund policy  document {refund}")
        say("try:")
        say(f"  curl -s -H 'Authorization: Bearer {acme.key}' \\")
        say(f"       -H 'content-type: application/json' -d '{body}' \\")
        say(f"       {base}/v1/tenants/{tenant}/search")
        say(f"logs: {self.home}/*.log · stop: kb demo --stop && kb dev down")

    def story(self, api: ApiClient) -> str:
        acme = self.stack.tenant("acme")
        self.publish_policies(api, acme)
        refund = self.publish_v1(api, acme)
        self.throttled_v2(api, acme, refund)
        self.corrupt_v3(api, acme, refund)
        self.walls(api, acme, refund)
        self.crash(api, acme)
        return refund

    # --- the steps ----------------------------------------------------------------------------

    def publish_policies(self, api: ApiClient, acme: Tenant) -> None:
        with self.console.step("publish a dozen policies (search needs something to rank)") as step:
            step.log = self.stack.log("indexer-standard")
            published = []
            for path in sorted((EXAMPLES / "policies").iterdir()):
                title = path.stem.replace("-", " ").capitalize()
                created = api.upload_file(acme, path, title=title)
                published.append(api.publish(acme, created, [SUPPORT]))
            for item in published:
                self.until_status(step, api, acme, item["documentId"], "SEARCHABLE")
            step.done(f"{len(published)} documents SEARCHABLE (Markdown, text, HTML)")

    def publish_v1(self, api: ApiClient, acme: Tenant) -> str:
        with self.console.step("publish refund policy v1 (Markdown)") as step:
            step.log = self.stack.log("indexer-standard")
            v1 = api.upload_file(acme, EXAMPLES / "refund-policy" / "v1.md", title="Refund policy")
            refund: str = v1["documentId"]
            task = api.publish(acme, v1, [SUPPORT])["indexTaskId"]
            self.until_status(step, api, acme, refund, "SEARCHABLE")
            step.done(f"202 at once (task {task[:8]}…), then SEARCHABLE")
        with self.console.step(f"search “{QUESTION}”") as step:
            hits = api.search(acme, QUESTION, [SUPPORT])
            self.refund_versions(step, hits, refund, {1})
            step.done("answered from v1 (30 days)")
        self.show(hits)
        return refund

    def throttled_v2(self, api: ApiClient, acme: Tenant, refund: str) -> None:
        with self.console.step("the provider answers 429 while v2 (DOCX) is published") as step:
            step.log = self.stack.log("indexer-standard")
            api.http.post(f"{self.stack.provider_url}/_control/throttle", json={"seconds": 4})
            v2 = api.upload(
                acme,
                "refund-policy-v2.docx",
                refund_policy_docx(EXAMPLES / "refund-policy" / "v2.txt", self.edition),
                document_id=refund,
                media_type=DOCX,
            )
            task_id = api.publish(acme, v2, [SUPPORT])["indexTaskId"]
            retrying = step.until(
                "the task to back off", lambda: self.task_in(api, acme, task_id, {"RETRY_WAIT"})
            )
            status = api.document(acme, refund)
            hits = api.search(acme, QUESTION, [SUPPORT])
            self.refund_versions(step, hits, refund, {1})
            if status["indexStatus"] != "INDEXING" or status["searchVersion"] != 1:
                raise StepFailed(step.title, f"expected INDEXING on v1, got {status}")
            step.done(
                f"{retrying['errorCode']}: RETRY_WAIT, document INDEXING, "
                "search still answers from v1 only"
            )
        with self.console.step("the throttling ends: v2 becomes searchable") as step:
            step.log = self.stack.log("indexer-standard")
            self.until_status(step, api, acme, refund, "SEARCHABLE", timeout=120)
            hits = api.search(acme, QUESTION, [SUPPORT])
            self.refund_versions(step, hits, refund, {2})
            step.done("SEARCHABLE on v2: search answers from v2 only (45 days)")
        self.show(hits)

    def corrupt_v3(self, api: ApiClient, acme: Tenant, refund: str) -> None:
        with self.console.step("publish a corrupt PDF as v3") as step:
            step.log = self.stack.log("indexer-standard")
            v3 = api.upload(
                acme, "v3.pdf", CORRUPT_PDF, document_id=refund, media_type="application/pdf"
            )
            api.publish(acme, v3, [SUPPORT])
            status = self.until_status(step, api, acme, refund, "FAILED", timeout=120)
            code = (status.get("failure") or {}).get("errorCode")
            hits = api.search(acme, QUESTION, [SUPPORT])
            self.refund_versions(step, hits, refund, {2})
            step.done(f"FAILED: {code}; search still serves v{status['searchVersion']}")

    def walls(self, api: ApiClient, acme: Tenant, refund: str) -> None:
        globex = self.stack.tenant("globex")
        with self.console.step("walls: a principal outside the ACL, another tenant's key") as step:
            outside = [
                h for h in api.search(acme, QUESTION, ["group:sales"]) if h["documentId"] == refund
            ]
            other = api.search_as(globex, acme.tenant_id, QUESTION, [SUPPORT])
            if outside or other.status_code != 403:
                raise StepFailed(
                    step.title, f"walls leaked: {len(outside)} hits, HTTP {other.status_code}"
                )
            step.done("group:sales sees nothing of it; globex's key on acme's path: 403")

    def crash(self, api: ApiClient, acme: Tenant) -> None:
        stack = self.stack
        with self.console.step("SIGKILL an indexer in the middle of a task") as step:
            step.log = stack.log("indexer-standard")
            created = api.upload(
                acme,
                "handbook.md",
                handbook_text(self.edition).encode(),
                title="Field operations handbook",
                media_type=MARKDOWN,
            )
            task_id = api.publish(acme, created, [SUPPORT])["indexTaskId"]
            running = step.until(
                "the task to start", lambda: self.task_in(api, acme, task_id, {"RUNNING"})
            )
            victim = stack.processes.running("indexer-standard")
            stack.processes.kill("indexer-standard")
            stack.start_indexer("standard")  # what a supervisor (systemd, Kubernetes) does
            done = step.until(
                "another indexer to take the task over",
                lambda: self.task_in(api, acme, task_id, {"SUCCEEDED", "DEAD"}),
                timeout=300,
            )
            if done["status"] != "SUCCEEDED" or done["attempts"] <= running["attempts"]:
                raise StepFailed(step.title, f"expected a takeover, got {done}")
            step.done(
                f"killed pid {victim.pid if victim else '?'} during attempt "
                f"{running['attempts']}; taken over: SUCCEEDED on attempt {done['attempts']}"
            )

    # --- helpers ------------------------------------------------------------------------------

    def until_status(
        self,
        step: Step,
        api: ApiClient,
        tenant: Tenant,
        document_id: str,
        wanted: str,
        timeout: float = 180,
    ) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            status = api.document(tenant, document_id)
            return status if status["indexStatus"] == wanted else None

        found: dict[str, Any] = step.until(f"the document to be {wanted}", check, timeout)
        return found

    @staticmethod
    def task_in(
        api: ApiClient, tenant: Tenant, task_id: str, states: set[str]
    ) -> dict[str, Any] | None:
        task = api.task(tenant, task_id)
        return task if task["status"] in states else None

    @staticmethod
    def refund_versions(
        step: Step, hits: list[dict[str, Any]], refund: str, allowed: set[int]
    ) -> None:
        versions = {h["versionNumber"] for h in hits if h["documentId"] == refund}
        if not versions or not versions <= allowed:
            raise StepFailed(
                step.title, f"the refund policy answered from versions {versions}, not {allowed}"
            )

    def show(self, results: list[dict[str, Any]], limit: int = 3) -> None:
        for rank, hit in enumerate(results[:limit], 1):
            heading = " > ".join(hit["headingPath"]) or "(top)"
            text = " ".join(hit["text"].split())
            text = text if len(text) <= 90 else text[:89] + "…"
            self.console.say(
                f"    {rank}. {hit['title']} v{hit['versionNumber']} > {heading}  "
                f"(score {hit['score']:.4f})\n       “{text}”"
            )
