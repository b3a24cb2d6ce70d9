"""Chunking time per document, this tree against another (the code before a change).

    uv run python -m bench.chunking_time --against ../main --rounds 3

Only chunking is timed (``chunk_sections``, the indexer's strategy for the shipped
all-MiniLM-L6-v2: 254 tokens, its own tokenizer); the documents are parsed once,
beforehand. Three corpora:

- ``documents``: the throughput bench's plain-text documents (``bench.indexing_throughput``,
  ~1,330 characters in paragraphs, one chunk each);
- ``long``: plain text of 20 such paragraphs (~6 KB, several chunks each);
- ``examples``: the 37 documents of the labelled search set (``bench.quality_examples``:
  Markdown, HTML, PDF, DOCX and text, sections under headings);
- ``split``: Markdown of four such paragraphs under one title, kept apart by empty
  headings (as empty heading-styled paragraphs do in Word): four sections under one path.

Each tree's code runs in a process of its own (``PYTHONPATH`` set to the tree), the trees
taking turns for ``--rounds`` rounds, so that a machine shared with other work slows both
alike; within a process each corpus is chunked ``--repeat`` times and the fastest pass
counts, in CPU time (the process's, less disturbed by other processes than wall time).
Beside the time, what does not depend on the machine: how often the tokenizer was called
and how many characters it was given, per document. Prints a Markdown table (CPU time:
median over the rounds) and, with ``--json``, every run.
Not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.indexing_throughput import corpus, paragraph
from bench.quality_examples import example_documents
from services.embedding.onnx_local import default_tokenizer_file
from services.indexer.pipeline.parsing import parse_document
from services.runtime.indexing.media_types import MARKDOWN, TEXT

THIS_TREE = Path(__file__).resolve().parents[1]

# Runs in each tree's own process: only names both trees have (chunk_sections,
# ChunkingStrategy, Section, the token counter), so the older code can be timed too.
_WORKER = """
import json, sys, time, uuid
from services.embedding.tokens import TokenizerSpec, load_token_counter
from services.indexer.pipeline.chunking import ChunkingStrategy, chunk_sections
from services.indexer.pipeline.parsing import Section

job = json.load(open(sys.argv[1]))
spec = TokenizerSpec(
    name="all-MiniLM-L6-v2", tokenizer_file=job["tokenizer_file"],
    max_input_tokens=256, special_tokens=2,
)
strategy = ChunkingStrategy(spec, max_tokens=254)
count = load_token_counter(spec)
tally = [0, 0]

def tallied(text):
    tally[0] += 1
    tally[1] += len(text)
    return count(text)

def chunk_all(sections, counter):
    return sum(
        len(chunk_sections(doc, document_id=uuid.UUID(int=1), version_number=1,
                           strategy=strategy, count_tokens=counter))
        for doc in sections
    )

result = {}
for name, documents in job["corpora"].items():
    sections = [[Section(tuple(path), text) for path, text in doc] for doc in documents]
    tally[:] = [0, 0]
    chunks = chunk_all(sections, tallied)
    best = float("inf")
    for _ in range(job["repeat"]):
        began = time.process_time()
        chunk_all(sections, count)
        best = min(best, time.process_time() - began)
    result[name] = {
        "documents": len(sections), "chunks": chunks,
        "cpu_ms_per_document": best * 1000 / len(sections),
        "counts_per_document": tally[0] / len(sections),
        "characters_counted_per_document": tally[1] / len(sections),
        "characters_per_document": sum(len(t) for d in documents for _, t in d) / len(sections),
    }
print(json.dumps(result))
"""


def corpora(documents: int) -> dict[str, list[list[tuple[tuple[str, ...], str]]]]:
    def sections(media_type: str, content: bytes) -> list[tuple[tuple[str, ...], str]]:
        return [(s.heading_path, s.text) for s in parse_document(media_type, content)]

    rng = random.Random(11)
    long = [
        "\n\n".join(paragraph(rng, 280) for _ in range(20)).encode() for _ in range(documents // 5)
    ]
    # Markdown whose paragraphs an empty heading keeps apart (as an empty heading-styled
    # paragraph does in Word): four sections under one heading path.
    split = [
        f"# Handbook {n}\n\n".encode()
        + "\n\n##\n\n".join(paragraph(rng, 280) for _ in range(4)).encode()
        for n in range(documents // 5)
    ]
    return {
        "documents": [sections(TEXT, content) for content in corpus("documents", documents)],
        "long": [sections(TEXT, content) for content in long],
        "examples": [sections(d.media_type, d.content) for d in example_documents()],
        "split": [sections(MARKDOWN, content) for content in split],
    }


def run_tree(tree: Path, job_file: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(
        [sys.executable, "-c", _WORKER, job_file],
        cwd=tree,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", type=Path, required=True, help="the other tree's root")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--documents", type=int, default=500)
    parser.add_argument("--json", action="store_true", help="also print every run")
    args = parser.parse_args()
    trees = {"before": args.against.resolve(), "after": THIS_TREE}
    job = {
        "tokenizer_file": str(default_tokenizer_file()),
        "repeat": args.repeat,
        "corpora": corpora(args.documents),
    }
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label in trees}
    with tempfile.NamedTemporaryFile("w", suffix=".json") as job_file:
        json.dump(job, job_file)
        job_file.flush()
        for _ in range(args.rounds):
            for label, tree in trees.items():
                runs[label].append(run_tree(tree, job_file.name))
    lines = [
        f"command `python -m bench.chunking_time {' '.join(sys.argv[1:])}`,"
        f" before = {trees['before']}, after = {trees['after']}",
        "",
        "| corpus | documents | chars/doc | chunks | tokenizer calls/doc | chars tokenized/doc"
        " | CPU ms/doc | after / before |",
        "|---|---:|---:|---|---|---|---|---:|",
    ]
    for name in job["corpora"]:
        first = {label: runs[label][0][name] for label in trees}
        cpu = {
            label: statistics.median(r[name]["cpu_ms_per_document"] for r in runs[label])
            for label in trees
        }

        def pair(key: str, digits: int, first: dict[str, Any] = first) -> str:
            return f"{first['before'][key]:.{digits}f} -> {first['after'][key]:.{digits}f}"

        lines.append(
            f"| {name} | {first['after']['documents']}"
            f" | {first['after']['characters_per_document']:.0f} | {pair('chunks', 0)}"
            f" | {pair('counts_per_document', 1)} | {pair('characters_counted_per_document', 0)}"
            f" | {cpu['before']:.3f} -> {cpu['after']:.3f}"
            f" | {cpu['after'] / cpu['before']:.2f}x |"
        )
    print("\n".join(lines))
    if args.json:
        print(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
