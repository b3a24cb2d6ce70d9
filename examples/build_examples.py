"""Builds the binary forms of the example documents (DOCX, PDF): refund-policy/v2.* from
refund-policy/v2.txt, and the handbook's PDF and DOCX documents from handbook/sources/*.txt.

Run once after editing a text: `uv run python examples/build_examples.py`. The outputs are
committed, so `kb demo` and the search quality bench need neither python-docx's writer path
nor fpdf2 at run time. The outputs are deterministic (fixed creation dates).

A handbook source is: the title line, an intro line, then ``## Heading`` lines, each
followed by paragraphs (separated by blank lines) or table rows (``| a | b | c``, the first
row is the header).
"""

from __future__ import annotations

import html
import zipfile
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


# handbook/sources/<name>.txt -> handbook/<name>.<format>
HANDBOOK_FORMATS = {
    "payroll": "pdf",
    "warehouse-safety": "pdf",
    "offboarding": "pdf",
    "wholesale-faq": "pdf",
    "reloop": "pdf",
    "expense-tool-errors": "docx",
    "benefits": "docx",
    "equipment-policy": "docx",
    "whistleblowing": "docx",
    "data-requests": "docx",
}

Block = str | list[list[str]]  # a paragraph, or a table's rows


def handbook_sections(text: str) -> tuple[str, str, list[tuple[str, list[Block]]]]:
    lines = text.splitlines()
    title, intro = lines[0].strip(), lines[1].strip()
    parts: list[tuple[str, list[Block]]] = []
    paragraph: list[str] = []

    def flush() -> None:
        if paragraph:
            parts[-1][1].append(" ".join(paragraph))
            paragraph.clear()

    for line in lines[2:]:
        line = line.strip()
        if line.startswith("## "):
            flush()
            parts.append((line[3:], []))
        elif line.startswith("|"):
            flush()
            row = [cell.strip() for cell in line.strip("|").split("|")]
            blocks = parts[-1][1]
            if blocks and isinstance(blocks[-1], list):
                blocks[-1].append(row)
            else:
                blocks.append([row])
        elif not line:
            flush()
        else:
            paragraph.append(line)
    flush()
    return title, intro, parts


def _fix_zip_dates(path: Path) -> None:
    """python-docx stamps every zip member with the time of writing: rewrite them with the
    fixed date so that a rebuild of unchanged text gives the same bytes."""
    with zipfile.ZipFile(path) as source:
        members = [(info, source.read(info)) for info in source.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as target:
        for info, data in members:
            fixed = zipfile.ZipInfo(info.filename, date_time=FIXED.timetuple()[:6])
            fixed.compress_type = zipfile.ZIP_DEFLATED
            fixed.external_attr = info.external_attr
            target.writestr(fixed, data)


def write_handbook_docx(
    title: str, intro: str, parts: list[tuple[str, list[Block]]], path: Path
) -> None:
    document = docx.Document()
    document.core_properties.created = FIXED
    document.core_properties.modified = FIXED
    document.add_heading(title, level=1)
    document.add_paragraph(intro)
    for heading, blocks in parts:
        document.add_heading(heading, level=2)
        for block in blocks:
            if isinstance(block, str):
                document.add_paragraph(block)
                continue
            table = document.add_table(rows=len(block), cols=len(block[0]))
            table.style = "Table Grid"
            for r, row in enumerate(block):
                for c, cell in enumerate(row):
                    table.cell(r, c).text = cell
    document.save(str(path))
    _fix_zip_dates(path)


def write_handbook_pdf(
    title: str, intro: str, parts: list[tuple[str, list[Block]]], path: Path
) -> None:
    pdf = FPDF()
    pdf.set_creation_date(FIXED)
    pdf.add_page()
    pdf.set_font("helvetica", size=18)
    pdf.start_section(title, level=0)
    pdf.multi_cell(0, 10, title, new_x="LMARGIN", new_y="NEXT")
    pdf.set_font("helvetica", size=11)
    pdf.multi_cell(0, 6, intro, new_x="LMARGIN", new_y="NEXT")
    for heading, blocks in parts:
        pdf.set_font("helvetica", size=14)
        pdf.start_section(heading, level=1)
        pdf.multi_cell(0, 9, heading, new_x="LMARGIN", new_y="NEXT")
        pdf.set_font("helvetica", size=11)
        for block in blocks:
            rows = [block] if isinstance(block, str) else [" - ".join(r) for r in block]
            for text in rows:
                pdf.multi_cell(0, 6, text, new_x="LMARGIN", new_y="NEXT")
            pdf.ln(2)
    pdf.output(str(path))


def build_handbook() -> None:
    for name, fmt in HANDBOOK_FORMATS.items():
        source = HERE / "handbook" / "sources" / f"{name}.txt"
        title, intro, parts = handbook_sections(source.read_text("utf-8"))
        writer = write_handbook_pdf if fmt == "pdf" else write_handbook_docx
        writer(title, intro, parts, HERE / "handbook" / f"{name}.{fmt}")


def main() -> None:
    title, intro, parts = sections((HERE / "refund-policy" / "v2.txt").read_text("utf-8"))
    write_docx(title, intro, parts, HERE / "refund-policy" / "v2.docx")
    write_pdf(title, intro, parts, HERE / "refund-policy" / "v2.pdf")
    write_html(title, intro, parts, HERE / "refund-policy" / "v2.html")
    build_handbook()


if __name__ == "__main__":
    main()
