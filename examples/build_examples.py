"""Builds the binary forms of the example documents (DOCX, PDF) from refund-policy/v2.txt.

Run once after editing the text: `uv run python examples/build_examples.py`. The outputs are
committed, so `kb demo` needs neither python-docx's writer path nor fpdf2 at run time.
"""

from __future__ import annotations

import html
from datetime import UTC, datetime
from pathlib import Path

import docx
from fpdf import FPDF

HERE = Path(__file__).resolve().parent
FIXED = datetime(2026, 1, 1, tzinfo=UTC)


def sections(text: str) -> tuple[str, str, list[tuple[str, str]]]:
    lines = [line for line in text.splitlines() if line.strip()]
    title, intro, parts = lines[0], lines[1], []
    for line in lines[2:]:
        if line.startswith("## "):
            parts.append((line[3:], ""))
        else:
            heading, body = parts[-1]
            parts[-1] = (heading, (body + " " + line).strip())
    return title, intro, parts


def write_docx(title: str, intro: str, parts: list[tuple[str, str]], path: Path) -> None:
    document = docx.Document()
    document.core_properties.created = FIXED
    document.core_properties.modified = FIXED
    document.add_heading(title, level=1)
    document.add_paragraph(intro)
    for heading, body in parts:
        document.add_heading(heading, level=2)
        document.add_paragraph(body)
    document.save(str(path))


def write_pdf(title: str, intro: str, parts: list[tuple[str, str]], path: Path) -> None:
    pdf = FPDF()
    pdf.set_creation_date(FIXED)
    pdf.add_page()
    pdf.set_font("helvetica", size=18)
    pdf.start_section(title, level=0)
    pdf.multi_cell(0, 10, title, new_x="LMARGIN", new_y="NEXT")
    pdf.set_font("helvetica", size=11)
    pdf.multi_cell(0, 6, intro, new_x="LMARGIN", new_y="NEXT")
    for heading, body in parts:
        pdf.set_font("helvetica", size=14)
        pdf.start_section(heading, level=1)
        pdf.multi_cell(0, 9, heading, new_x="LMARGIN", new_y="NEXT")
        pdf.set_font("helvetica", size=11)
        pdf.multi_cell(0, 6, body, new_x="LMARGIN", new_y="NEXT")
    pdf.output(str(path))


def write_html(title: str, intro: str, parts: list[tuple[str, str]], path: Path) -> None:
    body = "".join(f"<h2>{html.escape(h)}</h2>\n<p>{html.escape(b)}</p>\n" for h, b in parts)
    path.write_text(
        "<!doctype html>\n<html><head><title>Refund policy</title>"
        "<style>body{font-family:sans-serif}</style></head>\n<body>\n"
        "<nav><a href='/'>Home</a> · <a href='/help'>Help</a></nav>\n"
        f"<h1>{html.escape(title)}</h1>\n<p>{html.escape(intro)}</p>\n{body}"
        "<footer>© Northwind Outfitters</footer>\n</body></html>\n",
        encoding="utf-8",
    )


def main() -> None:
    title, intro, parts = sections((HERE / "refund-policy" / "v2.txt").read_text("utf-8"))
    write_docx(title, intro, parts, HERE / "refund-policy" / "v2.docx")
    write_pdf(title, intro, parts, HERE / "refund-policy" / "v2.pdf")
    write_html(title, intro, parts, HERE / "refund-policy" / "v2.html")


if __name__ == "__main__":
    main()
