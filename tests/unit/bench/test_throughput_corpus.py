"""The throughput benches' generated corpus in LangChain's benchmark shape: the same every
run, short Markdown notes of ~580 characters in 1-3 paragraphs."""

from __future__ import annotations

from statistics import mean

from bench.indexing_throughput import MEDIA_TYPES, corpus


def test_markdown_notes_are_the_same_every_run_and_of_the_benchmark_shape() -> None:
    notes = corpus("markdown-notes", 500)
    assert notes == corpus("markdown-notes", 500)
    assert len(set(notes)) == 500
    assert 540 <= mean(map(len, notes)) <= 620
    paragraphs = [
        [block for block in note.decode().split("\n\n") if not block.startswith("#")]
        for note in notes
    ]
    assert {len(blocks) for blocks in paragraphs} == {1, 2, 3}
    assert all(note.startswith(b"# ") for note in notes)
    assert MEDIA_TYPES["markdown-notes"] == "text/markdown"
