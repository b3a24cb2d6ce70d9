from __future__ import annotations

import pytest

from services.indexer.pipeline.parsing import Section, parse_document
from services.runtime.indexing.media_types import MARKDOWN
from tests.support.documents import SAMPLE, expected_sections, make_markdown


def parsed(content: bytes) -> list[tuple[tuple[str, ...], str]]:
    return [(section.heading_path, section.text) for section in parse_document(MARKDOWN, content)]


@pytest.mark.parametrize("setext", [False, True])
def test_headings_build_the_heading_path(setext: bool) -> None:
    assert parsed(make_markdown(SAMPLE, setext=setext)) == expected_sections(SAMPLE)


def test_exact_paths_of_the_sample() -> None:
    assert [path for path, _ in parsed(make_markdown())] == [
        ("Refund policy",),
        ("Refund policy", "Window"),
        ("Refund policy", "Window", "Late requests"),
        ("Refund policy", "Exceptions"),
        ("Shipping",),
        ("Shipping", "Customs"),
    ]


def test_hash_inside_a_code_fence_is_not_a_heading() -> None:
    content = b"# Setup\n\nRun this:\n\n```sh\n# not a heading\necho hi\n```\n\n## Next\n\nDone.\n"
    assert parsed(content) == [
        (("Setup",), "Run this:\n\n# not a heading\necho hi"),
        (("Setup", "Next"), "Done."),
    ]


def test_text_before_the_first_heading_has_an_empty_path_and_skipped_levels_nest() -> None:
    content = b"Preface.\n\n# One\n\n### Deep\n\nDeep text.\n\n## Two\n\nTwo text.\n"
    assert parsed(content) == [
        ((), "Preface."),
        (("One", "Deep"), "Deep text."),
        (("One", "Two"), "Two text."),
    ]


def test_lists_tables_quotes_and_inline_markup_become_text() -> None:
    content = (
        b"# Plans\n\n"
        b"Choose **one** of the `plans` [here](http://example.com) ![diagram](d.png).\n\n"
        b"- Basic\n- Plus\n  - Plus yearly\n\n"
        b"1. first\n2. second\n\n"
        b"| Plan | Days |\n|------|------|\n| Basic | 14 |\n| Plus | 30 |\n\n"
        b"> Quoted\n> advice.\n"
    )
    assert parsed(content) == [
        (
            ("Plans",),
            "Choose one of the plans here diagram.\n\n"
            "- Basic\n- Plus\n- Plus yearly\n\n"
            "1. first\n2. second\n\n"
            "Plan | Days\nBasic | 14\nPlus | 30\n\n"
            "Quoted advice.",
        )
    ]


def test_empty_heading_sections_are_dropped() -> None:
    content = b"# Empty\n\n# Also empty\n\n## Child\n\nText.\n"
    assert parse_document(MARKDOWN, content) == [Section(("Also empty", "Child"), "Text.")]


def test_raw_html_blocks_contribute_their_text() -> None:
    assert parsed(b"# A\n\n<div>raw <b>html</b> &amp; more</div>\n") == [
        (("A",), "raw html & more")
    ]


def test_front_matter_is_metadata_not_a_heading() -> None:
    content = b"---\ntitle: Handbook\ntags: [a, b]\n---\nIntro.\n\n# A\n\ntext\n"
    assert parsed(content) == [((), "Intro."), (("A",), "text")]


def test_a_thematic_break_later_on_is_not_front_matter() -> None:
    content = b"Intro.\n\n---\n\nMore.\n"
    assert parsed(content) == [((), "Intro.\n\nMore.")]


def test_the_tokenizer_is_built_once_and_carries_nothing_between_documents(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Building markdown-it's parser (its rule chains, its renderer) cost more than parsing
    # a short note: it is built once a process, and a document's link references must not
    # reach the next document through it.
    from markdown_it import MarkdownIt

    from services.indexer.pipeline.parsing import markdown

    built: list[MarkdownIt] = []
    real_init = MarkdownIt.__init__

    def counting_init(self: MarkdownIt, *args: object, **kwargs: object) -> None:
        built.append(self)
        real_init(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(MarkdownIt, "__init__", counting_init)
    monkeypatch.setattr(markdown, "_PARSER", None, raising=False)
    defines = b"# One\n\nSee [the guide][g].\n\n[g]: https://example.com/guide\n"
    uses = b"# Two\n\nSee [the guide][g].\n"
    alone = parsed(uses)
    assert parsed(defines) == [(("One",), "See the guide.")]
    assert parsed(uses) == alone == [(("Two",), "See [the guide][g].")]
    assert len(built) == 1


_RACED = b"# Title\n\nSome *text* with `code` and a [link](https://example.com).\n\n" + (
    b"- one\n- two\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n> quoted ~~gone~~\n"
)


def test_threads_first_parses_on_a_fresh_parser_all_see_every_rule(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The parser is built lazily and shared by the threads of ParsePool(inline=True):
    # markdown-it compiles its rule chains on first use, publishing an empty chain before
    # filling it, so a thread must never get the parser before its chains are compiled.
    import sys
    import threading

    from services.indexer.pipeline.parsing import markdown

    monkeypatch.setattr(markdown, "_PARSER", None)
    expected = parsed(_RACED)
    # Switching threads far more often than usual makes the window show up in a few
    # hundred rounds, as it does on a loaded machine.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    threads_count = 6
    wrong: list[object] = []
    try:
        for _ in range(300):
            monkeypatch.setattr(markdown, "_PARSER", None)
            start = threading.Barrier(threads_count)
            results: list[object] = []

            def first_parse(start: threading.Barrier = start, out: list[object] = results) -> None:
                start.wait()
                try:
                    out.append(parsed(_RACED))
                except Exception as error:  # what a thread saw is what the test reports
                    out.append(repr(error))

            threads = [threading.Thread(target=first_parse) for _ in range(threads_count)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            wrong.extend(result for result in results if result != expected)
    finally:
        sys.setswitchinterval(interval)
    assert wrong == []


def test_the_shared_parser_is_published_with_every_rule_chain_compiled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from services.indexer.pipeline.parsing import markdown

    monkeypatch.setattr(markdown, "_PARSER", None)
    parser = markdown._markdown()
    caches: list[object] = [
        parser.core.ruler.__cache__,
        parser.block.ruler.__cache__,
        parser.inline.ruler.__cache__,
        parser.inline.ruler2.__cache__,
    ]
    assert [cache is not None for cache in caches] == [True] * 4
