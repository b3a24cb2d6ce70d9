"""Documents for tests, generated in every supported format from one outline.

``SAMPLE`` is a small document with nested headings; ``expected_sections(SAMPLE)`` is what
every parser must turn any of its renderings into. The bad inputs (corrupt and encrypted
PDFs, a scan without text, a DOCX zip bomb) are here too, so any test can feed them to the
pipeline.
"""

from __future__ import annotations

import html
import io
import random
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass

from docx import Document
from fpdf import FPDF


@dataclass(frozen=True)
class DocSection:
    level: int  # 1 = top-level heading
    title: str
    paragraphs: tuple[str, ...]


SAMPLE: tuple[DocSection, ...] = (
    DocSection(
        1,
        "Refund policy",
        ("Refunds are available to every customer & partner who asks in writing.",),
    ),
    DocSection(
        2,
        "Window",
        (
            "Ask within 30 days of the purchase date.",
            "Keep the receipt: it proves the date of purchase.",
        ),
    ),
    DocSection(3, "Late requests", ("A late request goes to a manager for review.",)),
    DocSection(2, "Exceptions", ("Gift cards and downloads are final sales.",)),
    DocSection(1, "Shipping", ("We ship to every country with a postal service.",)),
    DocSection(2, "Customs", ("Customs duties are paid by the recipient.",)),
)


def heading_paths(sections: Sequence[DocSection]) -> list[tuple[str, ...]]:
    """Each section's heading path, by the same nesting rule the parsers follow."""
    open_: list[tuple[int, str]] = []
    paths: list[tuple[str, ...]] = []
    for section in sections:
        while open_ and open_[-1][0] >= section.level:
            open_.pop()
        open_.append((section.level, section.title))
        paths.append(tuple(title for _, title in open_))
    return paths


def expected_sections(sections: Sequence[DocSection]) -> list[tuple[tuple[str, ...], str]]:
    """(heading path, text) per section: paragraphs separated by one blank line."""
    return [
        (path, "\n\n".join(section.paragraphs))
        for path, section in zip(heading_paths(sections), sections, strict=True)
    ]


# --- text and markup ---------------------------------------------------------------------


def make_text(paragraphs: Sequence[str], *, encoding: str = "utf-8", bom: bool = False) -> bytes:
    text = "\n\n".join(paragraphs) + "\n"
    prefix = "\ufeff" if bom else ""
    return (prefix + text).encode(encoding)


def make_large_text(paragraphs: int = 4000) -> bytes:
    """A long plain text of distinct numbered sentences (about 100 bytes a paragraph)."""
    return make_text(
        [
            f"Paragraph {n} explains clause {n * 7 % 101} of the agreement in plain words."
            for n in range(paragraphs)
        ]
    )


def make_markdown(sections: Sequence[DocSection] = SAMPLE, *, setext: bool = False) -> bytes:
    """ATX headings (``setext`` renders levels 1 and 2 as underlined headings)."""
    lines: list[str] = []
    for section in sections:
        if setext and section.level <= 2:
            lines += [section.title, ("=" if section.level == 1 else "-") * len(section.title)]
        else:
            lines.append("#" * section.level + " " + section.title)
        for paragraph in section.paragraphs:
            lines += ["", paragraph]
        lines.append("")
    return "\n".join(lines).encode()


def make_html(sections: Sequence[DocSection] = SAMPLE, *, noise: bool = True) -> bytes:
    """An HTML page; ``noise`` adds everything a reader does not see (title, script, style,
    navigation, page header and footer, hidden elements), which must not be indexed."""
    body: list[str] = []
    for section in sections:
        tag = f"h{min(section.level, 6)}"
        body.append(f"<{tag}>{html.escape(section.title)}</{tag}>")
        body += [f"<p>{html.escape(p)}</p>" for p in section.paragraphs]
        if noise:
            body.append('<p hidden>hidden paragraph</p><span aria-hidden="true">icon</span>')
    head = "<title>Page title</title><style>p { color: red }</style>" if noise else ""
    top = (
        "<header>Site header</header><nav>Home | About</nav>"
        '<script>var x = "script text";</script><noscript>enable js</noscript>'
        '<div style="display: none">invisible</div><template><p>template</p></template>'
        if noise
        else ""
    )
    bottom = "<footer>Site footer</footer>" if noise else ""
    page = (
        f'<!doctype html><html><head><meta charset="utf-8">{head}</head>'
        f"<body>{top}<main>{''.join(body)}</main>{bottom}</body></html>"
    )
    return page.encode()


# --- PDF -----------------------------------------------------------------------------------


def _pdf() -> FPDF:
    pdf = FPDF()
    pdf.set_auto_page_break(auto=True, margin=15)
    pdf.set_font("Helvetica", size=11)
    return pdf


def make_pdf(
    sections: Sequence[DocSection] = SAMPLE, *, outline: bool = True, page_per_section: bool = True
) -> bytes:
    """A PDF with real text; ``outline`` adds a bookmark per heading (fpdf2 sections)."""
    pdf = _pdf()
    pdf.add_page()
    for index, section in enumerate(sections):
        if page_per_section and index:
            pdf.add_page()
        if outline:
            pdf.start_section(section.title, level=section.level - 1, strict=False)
        pdf.set_font("Helvetica", style="B", size=14)
        pdf.multi_cell(0, 8, section.title, new_x="LMARGIN", new_y="NEXT")
        pdf.set_font("Helvetica", size=11)
        for paragraph in section.paragraphs:
            pdf.multi_cell(0, 6, paragraph, new_x="LMARGIN", new_y="NEXT")
            pdf.ln(4)
    return bytes(pdf.output())


def make_large_pdf(pages: int = 60, lines_per_page: int = 40) -> bytes:
    pdf = _pdf()
    for page in range(pages):
        pdf.add_page()
        pdf.start_section(f"Part {page}", level=0)
        for line in range(lines_per_page):
            pdf.cell(
                0,
                6,
                f"Page {page} line {line}: the clause reads the same in every copy.",
                new_x="LMARGIN",
                new_y="NEXT",
            )
    return bytes(pdf.output())


def make_encrypted_pdf(user_password: str = "secret") -> bytes:
    """Opens only with a password."""
    pdf = _pdf()
    pdf.set_encryption(owner_password="owner", user_password=user_password)
    pdf.add_page()
    pdf.cell(0, 10, "Confidential text.")
    return bytes(pdf.output())


def make_corrupt_pdf() -> bytes:
    """A PDF header followed by damage: no readable structure."""
    return b"%PDF-1.7\n1 0 obj << /Type /Catalog /Pages 2 0 R >>\n" + bytes(range(256)) * 4


def make_truncated_pdf() -> bytes:
    whole = make_pdf()
    return whole[: len(whole) // 3]


def make_scanned_pdf() -> bytes:
    """Pages that only carry drawings, as a scan without a text layer would."""
    pdf = _pdf()
    for _ in range(2):
        pdf.add_page()
        for row in range(20):
            pdf.rect(20, 20 + row * 12, 170, 8, style="F")
    return bytes(pdf.output())


# --- DOCX ----------------------------------------------------------------------------------


def make_docx(
    sections: Sequence[DocSection] = SAMPLE,
    *,
    title: str | None = None,
    table_after: int | None = None,
    table: Sequence[Sequence[str]] = (("Plan", "Days"), ("Basic", "14"), ("Plus", "30")),
) -> bytes:
    """``Heading N`` paragraphs per section (``Title`` first if given); ``table_after``
    puts ``table`` after that section's paragraphs."""
    document = Document()
    if title is not None:
        document.add_paragraph(title, style="Title")
    for index, section in enumerate(sections):
        document.add_heading(section.title, level=section.level)
        for paragraph in section.paragraphs:
            document.add_paragraph(paragraph)
        if table_after == index:
            rows = document.add_table(rows=len(table), cols=len(table[0]))
            for row, values in zip(rows.rows, table, strict=True):
                for cell, value in zip(row.cells, values, strict=True):
                    cell.text = value
    out = io.BytesIO()
    document.save(out)
    return out.getvalue()


def make_docx_zip_bomb(uncompressed_bytes: int = 16 * 1024 * 1024) -> bytes:
    """A valid-looking DOCX whose document part is mostly zeros: tiny compressed, huge open."""
    valid = zipfile.ZipFile(io.BytesIO(make_docx(SAMPLE[:1])))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED) as bomb:
        for member in valid.infolist():
            bomb.writestr(member.filename, valid.read(member.filename))
        with bomb.open("word/media/padding.bin", "w") as padding:
            block = bytes(1024 * 1024)
            for _ in range(uncompressed_bytes // len(block)):
                padding.write(block)
    return out.getvalue()


def make_docx_swelling(paragraphs: int = 8_000_000, padding_bytes: int = 512 * 1024) -> bytes:
    """A DOCX that passes the archive checks (about 48 MB of XML, ratio about 90) but whose
    word/document.xml -- millions of empty paragraphs -- takes lxml some 20x its size to
    open: the review's 1.1 MiB DOCX that peaked at 2.35 GB. Random padding keeps the
    compression ratio under the limit."""
    valid = zipfile.ZipFile(io.BytesIO(make_docx(SAMPLE[:1])))
    head, tail = valid.read("word/document.xml").split(b"<w:body>", 1)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED) as swelling:
        for member in valid.infolist():
            if member.filename != "word/document.xml":
                swelling.writestr(member.filename, valid.read(member.filename))
        with swelling.open("word/document.xml", "w") as document:
            document.write(head + b"<w:body>")
            block = b"<w:p/>" * 100_000
            for _ in range(paragraphs // 100_000):
                document.write(block)
            document.write(tail)
        swelling.writestr("word/media/padding.bin", random.Random(7).randbytes(padding_bytes))
    return out.getvalue()


def make_zip_not_docx() -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        archive.writestr("hello.txt", "not a word document")
    return out.getvalue()
