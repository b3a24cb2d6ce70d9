"""The demo's documents that must be new on every run: the index reuses the embeddings of
content it has seen (by digest), so a re-run publishing the very same bytes would never
reach the embedding provider, and the story's 429 and mid-task crash would not happen."""

from __future__ import annotations

import io
from pathlib import Path

import docx


def refund_policy_docx(text_file: Path, edition: str) -> bytes:
    """refund-policy/v2.txt as a Word document with headings, stamped with ``edition``."""
    lines = [line for line in text_file.read_text("utf-8").splitlines() if line.strip()]
    document = docx.Document()
    document.add_heading(lines[0], level=1)
    document.add_paragraph(f"{lines[1]} (edition {edition})")
    for line in lines[2:]:
        if line.startswith("## "):
            document.add_heading(line[3:], level=2)
        else:
            document.add_paragraph(line)
    out = io.BytesIO()
    document.save(out)
    return out.getvalue()


def handbook_text(edition: str, sections: int = 160) -> str:
    """A long document with distinct sections: long enough to be killed in the middle of."""
    sites = ["Lisbon", "Oslo", "Graz", "Tartu", "Lyon", "Cork", "Turku", "Brno"]
    parts = [f"# Field operations handbook (edition {edition})\n"]
    for n in range(1, sections + 1):
        site, bay = sites[n % len(sites)], n % 17 + 1
        parts.append(
            f"## Procedure {n}: {site} depot, bay {bay}\n\n"
            f"Before shift {n} of edition {edition}, the lead at the {site} depot checks bay "
            f"{bay}, signs sheet {1000 + n} and confirms that pallet rack {n * 7 % 113} holds "
            f"no more than {200 + n * 3} kilograms. Deviations go to the site manager within "
            f"{n % 5 + 1} hours, with photos, and are reviewed at weekly meeting number {n}.\n"
        )
    return "\n".join(parts)
