"""The load driver: publishes documents and new versions of them across the tenants, in
every supported format (some corrupt), with the readers of a version sometimes changed,
through the public HTTP API, retrying as a client would while the system is broken.

It also deletes and erases documents: while their task runs, right after a publish, long
after one, and erases documents deleted before (kbtools/chaos/checks/removals.py checks what
follows); a document published by command is deleted or erased by command. Each version's
content holds a marker of its own, drawn by the driver, which an erase must leave nowhere."""

from __future__ import annotations

import enum
import io
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import docx
import httpx

from kbtools.chaos.rig.topology import ChaosStack
from kbtools.chaos.traffic.ingest import SHARE, IngestProducer, SentCommand
from kbtools.chaos.traffic.poison import Poison
from kbtools.demo.client import Tenant

GROUPS = ("group:red", "group:blue")
OUTSIDER = "group:outsider"
WORDS = (
    "harbour", "invoice", "glacier", "turbine", "orchard", "ledger", "beacon", "falcon",
    "quarry", "meadow", "lantern", "copper", "saffron", "tundra", "mosaic", "pylon", "cobalt",
    "juniper", "walrus", "prism",
)  # fmt: skip
FORMATS = ("md", "txt", "html", "docx", "pdf", "corrupt-pdf")
# Of the publishes, those followed by a delete or an erase (of the version's document, or of
# one published long ago), and by an erase of a document deleted before.
REMOVE_WHILE_RUNNING = 0.04
REMOVE_RIGHT_AFTER = 0.04
REMOVE_LONG_AFTER = 0.04
REMOVE_ALL = 0.14
ERASE_SHARE = 0.5
LONG_AFTER_S = 15.0
MEDIA = {
    "md": "text/markdown",
    "txt": "text/plain",
    "html": "text/html",
    "docx": "application/vnd.openxmlformats-officedocument.wordprocessingml.document",
    "pdf": "application/pdf",
    "corrupt-pdf": "application/pdf",
}


def new_marker(rng: random.Random) -> str:
    return f"kbm{rng.getrandbits(64):016x}"


def lsn_of(token: str) -> int:
    """A `searchToken` (``"16/B374D848"``) as a WAL byte position."""
    high, _, low = token.partition("/")
    return (int(high, 16) << 32) | int(low, 16)


class RemovalKind(enum.StrEnum):
    WHILE_TASK_RUNS = "while its task ran"
    RIGHT_AFTER_PUBLISH = "right after its publish"
    AFTER_TASK = "once its task had ended"
    LONG_AFTER_PUBLISH = "long after its publish"
    ERASE_OF_DELETED = "of a deleted document"


@dataclass(frozen=True)
class Removal:
    tenant_id: str
    document_id: str
    kind: RemovalKind
    erased: bool  # an erase (which implies a delete)
    token: str  # the answer's searchToken
    lsn: int
    answered_at: float  # monotonic


@dataclass
class Published:
    tenant_id: str
    document_id: str
    version_number: int
    readers: list[str]
    kind: str
    marker: str = ""  # in the content ("" for a corrupt PDF, which holds no text of its own)
    revision: int | None = None  # the document's, as the publish answered it
    task_id: str | None = None
    at: float = 0.0  # monotonic, when the publish was answered
    document_key: str = ""  # the producer's key when published by command (ingest.py)


@dataclass
class LoadRecord:
    published: list[Published] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)  # what the API never accepted
    api_retries: int = 0
    removed: list[Removal] = field(default_factory=list)
    unanswered: set[str] = field(default_factory=set)  # removals that may have committed
    commands: list[SentCommand] = field(default_factory=list)  # sent by command
    poisons: list[Poison] = field(default_factory=list)  # sent before some of them


def text_of(rng: random.Random, serial: int, version: int, marker: str = "") -> list[str]:
    # The marker first, on a short line of its own: whole in every format's text (a PDF line
    # is cut at 90 characters and the page keeps 70 lines).
    paragraphs = [f"Reference {marker}."] if marker else []
    for section in range(rng.randint(2, 6)):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60)))
        paragraphs.append(f"Record {serial} version {version} part {section}: {words}.")
    return paragraphs


def render(kind: str, title: str, paragraphs: list[str]) -> bytes:
    if kind == "md":
        return (
            f"# {title}\n\n" + "\n\n".join(f"## Part {n}\n\n{p}" for n, p in enumerate(paragraphs))
        ).encode()
    if kind == "txt":
        return (title + "\n\n" + "\n\n".join(paragraphs)).encode()
    if kind == "html":
        body = "".join(f"<h2>Part {n}</h2><p>{p}</p>" for n, p in enumerate(paragraphs))
        return f"<html><head><title>{title}</title></head><body>{body}</body></html>".encode()
    if kind == "docx":
        document = docx.Document()
        document.add_heading(title, level=1)
        for paragraph in paragraphs:
            document.add_paragraph(paragraph)
        out = io.BytesIO()
        document.save(out)
        return out.getvalue()
    if kind == "pdf":
        return minimal_pdf([title, *paragraphs])
    return b"%PDF-1.7\n%corrupt: no objects, no cross-reference table\n"


def minimal_pdf(lines: list[str]) -> bytes:
    """A one-page PDF with ``lines`` as text (ASCII), with a correct cross-reference table."""

    def escape(text: str) -> str:
        return text.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")

    wrapped: list[str] = []
    for line in lines:
        while line:
            wrapped.append(line[:90])
            line = line[90:]
    stream = (
        "BT /F1 9 Tf 40 800 Td 11 TL "
        + " ".join(f"({escape(line)}) '" for line in wrapped[:70])
        + " ET"
    )
    objects = [
        "<< /Type /Catalog /Pages 2 0 R >>",
        "<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        "<< /Type /Page /Parent 2 0 R /MediaBox [0 0 595 842] "
        "/Resources << /Font << /F1 4 0 R >> >> /Contents 5 0 R >>",
        "<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
        f"<< /Length {len(stream)} >>\nstream\n{stream}\nendstream",
    ]
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for number, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += f"{number} 0 obj\n{body}\nendobj\n".encode("latin-1")
    xref = len(out)
    out += f"xref\n0 {len(objects) + 1}\n0000000000 65535 f \n".encode()
    for offset in offsets:
        out += f"{offset:010d} 00000 n \n".encode()
    out += (
        f"trailer\n<< /Size {len(objects) + 1} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n"
    ).encode()
    return bytes(out)


class LoadDriver:
    def __init__(self, stack: ChaosStack, seed: int, documents: int, duration_s: float) -> None:
        self.stack = stack
        self.rng = random.Random(seed * 7919 + 1)
        self.documents = documents
        self.duration_s = duration_s
        self.record = LoadRecord()
        self.http = httpx.Client(base_url=stack.api_url, timeout=15)
        self.done = threading.Event()
        self.ended: float | None = None  # monotonic
        # Generators of their own: the publishes' draws are not shifted by these (a deleted
        # document still changes what follows: it gets no new version).
        self.removals = random.Random(seed * 6007 + 5)
        self.markers = random.Random(seed * 3011 + 2)
        self.by_event = random.Random(seed * 4001 + 3)  # which new documents go by command
        self.ingest = IngestProducer(
            stack.kafka.bootstrap, stack.database_url, stack.topic_prefix, stack.ingest_keys
        )
        self.record.commands = self.ingest.sent
        self.record.poisons = self.ingest.poisons

    def run(self) -> None:
        try:
            self._run()
        finally:
            self.ingest.close()
            self.ended = time.monotonic()
            self.done.set()

    def _run(self) -> None:
        rng = self.rng
        tenants = list(self.stack.tenants.values())
        started = time.monotonic()
        mine: list[Published] = []
        serial = 0
        while serial < self.documents:
            new_version = mine and rng.random() < 0.3
            if new_version:
                previous = rng.choice(mine)
                tenant = self.stack.tenants[previous.tenant_id]
                published = self.publish(tenant, serial, rng, previous)
            else:
                serial += 1
                published = self.publish(rng.choice(tenants), serial, rng, None)
            if published is not None:
                mine.append(published)
                self.record.published.append(published)
                mine = self.remove_some(mine, published)
            # Spread the documents over the load window (faster when behind).
            due = started + self.duration_s * serial / self.documents
            time.sleep(max(0.0, due - time.monotonic()))

    def publish(
        self, tenant: Tenant, serial: int, rng: random.Random, previous: Published | None
    ) -> Published | None:
        kind = rng.choice(FORMATS)
        version_hint = 1 if previous is None else previous.version_number + 1
        title = f"Record {serial}"  # never a marker: titles stay in Kafka after an erase
        marker = "" if kind == "corrupt-pdf" else new_marker(self.markers)
        content = render(kind, title, text_of(rng, serial, version_hint, marker))
        readers = sorted(rng.sample(GROUPS, rng.randint(1, 2)))
        if previous is not None and rng.random() < 0.5:
            readers = sorted(set(GROUPS) - set(previous.readers)) or readers  # an ACL change
        filename = f"record-{serial}.{kind.split('-')[-1]}"
        # A document published by command takes its next versions by command too.
        key = previous.document_key if previous else ""
        if previous is None and self.by_event.random() < SHARE:
            key = f"record-{serial}"
        if key:
            sent = (title, content, MEDIA[kind], filename)
            return self._publish_by_command(tenant, key, kind, marker, readers, sent)
        files = {"file": (filename, content, MEDIA[kind])}
        documents = f"/v1/tenants/{tenant.tenant_id}/documents"
        if previous is None:
            path, data = documents, {"title": title}
        else:
            path, data = f"{documents}/{previous.document_id}/versions", {}
        created = self.call("POST", path, tenant, {201}, files=files, data=data)
        if created is None:
            self.record.refused.append(f"upload {tenant.tenant_id} {path}")
            return None
        publish = f"{documents}/{created['documentId']}/versions/{created['versionNumber']}/publish"
        body = {"revision": created["revision"], "acl": {"read": readers}}
        answer = self.call("POST", publish, tenant, {202, 409}, json=body)
        if answer is None:
            self.record.refused.append(f"publish {tenant.tenant_id} {publish}")
            return None
        return Published(
            tenant.tenant_id,
            created["documentId"],
            created["versionNumber"],
            readers,
            kind,
            marker,
            answer.get("revision"),  # none after a 409 (a retry of a publish that committed)
            answer.get("indexTaskId"),
            time.monotonic(),
        )

    def _publish_by_command(
        self,
        tenant: Tenant,
        key: str,
        kind: str,
        marker: str,
        readers: list[str],
        sent: tuple[str, bytes, str, str],
    ) -> Published | None:
        """The publish as a signed command to the tier's ingest topic, by the producer's
        own document key (the same key for the document's next versions)."""
        title, content, media_type, filename = sent
        fields = {
            "title": title,
            "content": content,
            "mediaType": media_type,
            "filename": filename,
            "readPrincipals": readers,
        }
        answer = self.ingest.publish(tenant.tenant_id, tenant.tier, key, fields)
        if answer is None:
            self.record.refused.append(f"command {tenant.tenant_id} {key}")
            return None
        return Published(
            tenant.tenant_id,
            answer["document_id"],
            answer["version_number"],
            readers,
            kind,
            marker,
            answer["revision"],
            answer["task_id"],
            time.monotonic(),
            key,
        )

    # --- deletes and erases ---------------------------------------------------------------

    def remove_some(self, mine: list[Published], published: Published) -> list[Published]:
        """Now and then, delete or erase a document: the one just published (at once, or
        once its task runs), one published long ago, or one deleted before (an erase). The
        documents still live are returned: a deleted one takes no new version."""
        draw = self.removals.random()
        target: Published | None = published
        when = RemovalKind.RIGHT_AFTER_PUBLISH
        if draw < REMOVE_WHILE_RUNNING:
            when = self._await_running(published)
        elif draw < REMOVE_WHILE_RUNNING + REMOVE_RIGHT_AFTER:
            pass
        elif draw < REMOVE_WHILE_RUNNING + REMOVE_RIGHT_AFTER + REMOVE_LONG_AFTER:
            latest = {p.document_id: p for p in mine}  # each document's newest publish
            old = [p for p in latest.values() if p.at < time.monotonic() - LONG_AFTER_S]
            target = self.removals.choice(old) if old else None
            when = RemovalKind.LONG_AFTER_PUBLISH
        elif draw < REMOVE_ALL and self.record.removed:
            self._erase_a_deleted()
            return mine
        else:
            return mine
        if target is None:
            return mine
        erase = self.removals.random() < ERASE_SHARE
        if self._remove(target, when, erase=erase):
            return [p for p in mine if p.document_id != target.document_id]
        return mine

    def _await_running(self, published: Published) -> RemovalKind:
        """Until the version's task runs (read on the primary, every 50 ms, for at most
        10 s): what the delete then meets, as the task's last status said."""
        if published.task_id is None:
            return RemovalKind.RIGHT_AFTER_PUBLISH
        tenant = self.stack.tenants[published.tenant_id]
        path = f"/v1/tenants/{tenant.tenant_id}/index-tasks/{published.task_id}"
        deadline = time.monotonic() + 10
        status = "PENDING"
        while time.monotonic() < deadline:
            try:
                answer = self.http.get(path, headers=tenant.headers)
            except httpx.TransportError:
                answer = None
            if answer is not None and answer.status_code == 200:
                status = answer.json()["status"]
                if status != "PENDING":
                    break
            time.sleep(0.05)
        if status == "RUNNING":
            return RemovalKind.WHILE_TASK_RUNS
        if status in ("SUCCEEDED", "DEAD"):
            return RemovalKind.AFTER_TASK
        return RemovalKind.RIGHT_AFTER_PUBLISH  # not claimed yet, or waiting for a retry

    def _remove(self, target: Published, when: RemovalKind, *, erase: bool) -> bool:
        tenant = self.stack.tenants[target.tenant_id]
        path = f"/v1/tenants/{tenant.tenant_id}/documents/{target.document_id}"
        if target.document_key:  # published by command: removed by command
            answer = self.ingest.remove(
                tenant.tenant_id, tenant.tier, target.document_key, erase=erase
            )
        elif erase:
            # The tenant's first key, which the run searches and publishes with, is an admin
            # key (`kb tenants create`): the scope an erase needs.
            answer = self.call("POST", f"{path}/erase", tenant, {200})
        else:
            answer = self._delete(tenant, path, target.revision or 1)
        if answer is None:
            how = "by command " if target.document_key else ""
            self.record.refused.append(f"{'erase' if erase else 'delete'} {how}{path}")
            self.record.unanswered.add(target.document_id)
            return False
        self.record.removed.append(
            Removal(
                target.tenant_id,
                target.document_id,
                when,
                erase,
                answer["searchToken"],
                lsn_of(answer["searchToken"]),
                time.monotonic(),
            )
        )
        return True

    def _delete(self, tenant: Tenant, path: str, revision: int) -> dict[str, Any] | None:
        """DELETE with the revision the publish answered; on a stale one (a publish retried
        after its answer was lost), once more with the revision the conflict names."""
        for _ in range(3):
            answer = self.call("DELETE", path, tenant, {200, 409}, params={"revision": revision})
            if answer is None or "searchToken" in answer:
                return answer
            if "currentRevision" not in answer:
                return None
            revision = int(answer["currentRevision"])
        return None

    def _erase_a_deleted(self) -> None:
        erased = {r.document_id for r in self.record.removed if r.erased}
        deleted = [r for r in self.record.removed if r.document_id not in erased]
        if deleted:
            target = self.removals.choice(deleted)
            published = next(
                p for p in self.record.published if p.document_id == target.document_id
            )
            self._remove(published, RemovalKind.ERASE_OF_DELETED, erase=True)

    def call(
        self, method: str, path: str, tenant: Tenant, expected: set[int], **kwargs: Any
    ) -> dict[str, Any] | None:
        """The answer's body, retrying through outages for up to two minutes."""
        deadline = time.monotonic() + 120
        attempt = 0
        while time.monotonic() < deadline:
            try:
                answer = self.http.request(method, path, headers=tenant.headers, **kwargs)
            except httpx.TransportError:
                answer = None
            if answer is not None and answer.status_code in expected:
                body: dict[str, Any] = answer.json() if answer.content else {}
                return body
            if answer is not None and answer.status_code < 500 and answer.status_code != 429:
                return None
            attempt += 1
            self.record.api_retries += 1
            time.sleep(min(2.0, 0.2 * attempt))
        return None
