"""The load driver: publishes documents and new versions of them across the tenants, in
every supported format (some corrupt), with the readers of a version sometimes changed,
through the public HTTP API, retrying as a client would while the system is broken."""

from __future__ import annotations

import io
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import docx
import httpx

from kbtools.chaos.topology import ChaosStack
from kbtools.demo.client import Tenant

GROUPS = ("group:red", "group:blue")
OUTSIDER = "group:outsider"
WORDS = (
    "harbour", "invoice", "glacier", "turbine", "orchard", "ledger", "beacon", "falcon",
    "quarry", "meadow", "lantern", "copper", "saffron", "tundra", "mosaic", "pylon", "cobalt",
    "juniper", "walrus", "prism",
)  # fmt: skip
FORMATS = ("md", "txt", "html", "docx", "pdf", "corrupt-pdf")
MEDIA = {
    "md": "text/markdown",
    "txt": "text/plain",
    "html": "text/html",
    "docx": "application/vnd.openxmlformats-officedocument.wordprocessingml.document",
    "pdf": "application/pdf",
    "corrupt-pdf": "application/pdf",
}


@dataclass
class Published:
    tenant_id: str
    document_id: str
    version_number: int
    readers: list[str]
    kind: str


@dataclass
class LoadRecord:
    published: list[Published] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)  # what the API never accepted
    api_retries: int = 0


def text_of(rng: random.Random, serial: int, version: int) -> list[str]:
    paragraphs = []
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

    def run(self) -> None:
        try:
            self._run()
        finally:
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
            # Spread the documents over the load window (faster when behind).
            due = started + self.duration_s * serial / self.documents
            time.sleep(max(0.0, due - time.monotonic()))

    def publish(
        self, tenant: Tenant, serial: int, rng: random.Random, previous: Published | None
    ) -> Published | None:
        kind = rng.choice(FORMATS)
        version_hint = 1 if previous is None else previous.version_number + 1
        title = f"Record {serial}"
        content = render(kind, title, text_of(rng, serial, version_hint))
        readers = sorted(rng.sample(GROUPS, rng.randint(1, 2)))
        if previous is not None and rng.random() < 0.5:
            readers = sorted(set(GROUPS) - set(previous.readers)) or readers  # an ACL change
        files = {"file": (f"record-{serial}.{kind.split('-')[-1]}", content, MEDIA[kind])}
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
        if self.call("POST", publish, tenant, {202, 409}, json=body) is None:
            self.record.refused.append(f"publish {tenant.tenant_id} {publish}")
            return None
        return Published(
            tenant.tenant_id, created["documentId"], created["versionNumber"], readers, kind
        )

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
