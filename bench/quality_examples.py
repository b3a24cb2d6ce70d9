"""The labelled quality set: the example corpus shipped in ``examples/``, judged by section.

Documents: ``examples/policies/*`` (the 12 documents of ``kb demo``), the refund policy at
its current version (``examples/refund-policy/v2.docx``) and ``examples/handbook/*`` (PDF
and DOCX built from ``handbook/sources`` by ``examples/build_examples.py``): 37 documents in
all five formats. Each document is one unit of ``doc_key`` (its path under ``examples/``
without the extension).

The unit of judgment is a SECTION: the document and the heading path below its title, as
the real parser gives it (``handbook/payroll#overtime-and-supplements``; the text before the
first subheading, and a plain-text document, which has no headings, is ``<doc>#``). A chunk
maps to its section by its heading path, so a result is judged at the granularity a reader
sees, and two chunks of one section count once. ``corpus.jsonl`` lists the sections
(written by ``--write-corpus``); the bench checks that every judged section still exists.
"""

from __future__ import annotations

import json
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path

from services.indexer.pipeline.parsing import parse_document
from services.runtime.indexing.media_types import normalise_media_type

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
DATA = Path(__file__).resolve().parent / "search_quality_data"


@dataclass(frozen=True)
class SourceDocument:
    doc_key: str
    title: str
    media_type: str
    content: bytes


def example_documents(root: Path = EXAMPLES) -> list[SourceDocument]:
    paths = [*sorted((root / "policies").iterdir()), root / "refund-policy" / "v2.docx"]
    paths += sorted(p for p in (root / "handbook").iterdir() if p.is_file())
    documents = []
    for path in paths:
        key = str(path.relative_to(root).with_suffix(""))
        if key == "refund-policy/v2":
            key = "refund-policy"
        content = path.read_bytes()
        media_type = normalise_media_type(None, path.name)
        sections = parse_document(media_type, content)
        title = sections[0].heading_path[0] if sections[0].heading_path else path.stem
        documents.append(SourceDocument(key, title, media_type, content))
    return documents


def _slug(text: str) -> str:
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode().lower()
    return re.sub(r"[^a-z0-9]+", "-", text).strip("-")


def section_id(doc_key: str, heading_path: tuple[str, ...]) -> str:
    """The section's id: the document and its heading path below the title."""
    return f"{doc_key}#" + "/".join(_slug(h) for h in heading_path[1:])


def sections_of(documents: list[SourceDocument]) -> list[dict[str, str]]:
    rows: dict[str, dict[str, str]] = {}
    for doc in documents:
        for section in parse_document(doc.media_type, doc.content):
            sid = section_id(doc.doc_key, section.heading_path)
            if sid in rows:  # two sections under one heading path: one unit
                rows[sid]["text"] += "\n\n" + section.text
                continue
            title = " > ".join(section.heading_path) or doc.title
            rows[sid] = {"_id": sid, "title": title, "text": section.text}
    return list(rows.values())


def write_corpus(documents: list[SourceDocument], directory: Path = DATA) -> int:
    rows = sections_of(documents)
    with (directory / "corpus.jsonl").open("w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return len(rows)
