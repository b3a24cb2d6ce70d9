from __future__ import annotations

import pytest

from services.indexer.pipeline.parsing import parse_document
from services.indexer.task import ErrorCode, IndexingFailed
from services.runtime.indexing.media_types import HTML
from tests.support.documents import SAMPLE, expected_sections, make_html


def parsed(content: bytes) -> list[tuple[tuple[str, ...], str]]:
    return [(section.heading_path, section.text) for section in parse_document(HTML, content)]


@pytest.mark.parametrize("noise", [False, True])
def test_headings_build_the_heading_path_and_invisible_things_are_dropped(noise: bool) -> None:
    assert parsed(make_html(SAMPLE, noise=noise)) == expected_sections(SAMPLE)


def test_entities_are_decoded_and_the_title_is_not_body_text() -> None:
    content = (
        b"<html><head><title>Only metadata</title></head><body>"
        b"<h1>Fish &amp; chips</h1><p>caf&eacute; &lt;tag&gt; &#8364;5&nbsp;now</p>"
        b"</body></html>"
    )
    assert parsed(content) == [(("Fish & chips",), "café <tag> €5 now")]


@pytest.mark.parametrize(
    "hidden",
    [
        "<p hidden>secret</p>",
        '<div aria-hidden="TRUE"><p>secret</p></div>',
        '<div style="color: red; display:none"><p>secret</p></div>',
        "<script>document.write('secret')</script>",
        "<style>.secret {}</style>",
        "<nav><a href='/'>secret</a></nav>",
        "<header>secret</header>",
        "<footer>secret</footer>",
        "<template><p>secret</p></template>",
        "<noscript>secret</noscript>",
    ],
)
def test_hidden_and_chrome_elements_are_dropped(hidden: str) -> None:
    content = f"<body><h2>Topic</h2><p>visible</p>{hidden}<p>after</p></body>".encode()
    assert parsed(content) == [(("Topic",), "visible\n\nafter")]


def test_tables_lists_and_line_breaks_become_lines() -> None:
    content = (
        b"<body><h1>Plans</h1>"
        b"<table><tr><th>Plan</th><th>Days</th></tr>"
        b"<tr><td>Basic</td><td><p>14</p><p>days</p></td></tr></table>"
        b"<ul><li>one</li><li>two <b>bold</b></li></ul>"
        b"<ol><li>first</li><li>second</li></ol>"
        b"<p>line one<br>line   two</p><pre>code\n  indented</pre></body>"
    )
    assert parsed(content) == [
        (
            ("Plans",),
            "Plan | Days\nBasic | 14 days\n\n- one\n- two bold\n\n1. first\n2. second\n\n"
            "line one\nline two\n\ncode\nindented",
        )
    ]


def test_declared_charset_is_honoured_and_invalid_utf8_fails() -> None:
    latin = '<meta charset="iso-8859-1"><body><p>café</p></body>'.encode("latin-1")
    assert parsed(latin) == [((), "café")]
    with pytest.raises(IndexingFailed) as failed:
        parse_document(HTML, "<body><p>café</p></body>".encode("latin-1"))
    assert failed.value.code == ErrorCode.DOCUMENT_PARSE_FAILED


def test_deeply_nested_markup_does_not_exhaust_the_stack() -> None:
    depth = 5000
    content = ("<div>" * depth + "<h1>Deep</h1><p>bottom</p>" + "</div>" * depth).encode()
    assert parsed(content) == [(("Deep",), "bottom")]


def test_a_page_with_only_chrome_is_empty() -> None:
    with pytest.raises(IndexingFailed) as failed:
        parse_document(HTML, b"<head><title>t</title></head><body><nav>menu</nav></body>")
    assert failed.value.code == ErrorCode.DOCUMENT_EMPTY


def test_an_articles_own_header_is_content_and_hidden_heading_icons_are_not() -> None:
    content = (
        b"<body><header><h1>Site name</h1></header><main><article>"
        b'<header><h1>Post title <a aria-hidden="true" href="#t">#</a></h1>'
        b"<p>By Ann</p></header><p>Body.</p>"
        b"<footer>Posted in News</footer></article></main>"
        b"<footer>Copyright</footer></body>"
    )
    assert parsed(content) == [(("Post title",), "By Ann\n\nBody.\n\nPosted in News")]
