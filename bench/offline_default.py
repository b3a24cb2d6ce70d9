"""The offline default model on this machine's cores: the former setting (one model run at a
time on two intra-op threads) against the default (a request's inputs shared out between
one-thread runs at once, as many as the usable cores allow, up to four), in the same run.

    uv run python -m bench.offline_default --documents 500 --rounds 4

Indexing: ``bench.indexing_throughput``'s run (the documents published as the publisher
writes them, then one `kb indexer run` process), its provider the offline default itself
(``KB_EMBEDDING_PROVIDER=onnx-local``, in the indexer's process, as `kb demo` and an
offline deployment run it), once per side per round, the sides' order alternating. Per
side: docs/s from the process's start and steady (from the first claim), and the indexer's
CPU milliseconds per document.

The bare embedder: the same texts through ``OnnxLocalEmbedder`` as the pipeline calls it
(requests of ``--batch-size`` texts), a fresh process per side per round (so each side's
peak memory is its own), the sides alternating: inputs/s and the process's peak RSS, and
the largest difference between the two sides' vectors.

``--side NAME:VARIABLE=VALUE,...`` adds a side, measured in turn with the others; the first
side is the one the ratios divide by. Two inputs a run, two runs at once as the default
on two cores: ``two-a-run:KB_EMBEDDING_INFERENCE_BATCH_SIZE=2,KB_EMBEDDING_RUNS_PER_REQUEST=2``
(that batch size alone means one run at a time).

Needs DATABASE_URL (or the dev stack: `kb dev up`) unless ``--skip-indexer``. Not part of
the test suite; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

from bench.embedding import make_texts
from bench.indexing_throughput import MEDIA_TYPES, corpus, publish, run_indexer
from bench.pipeline import recreate

BENCH_DB = "kb_bench_offline_default"
# What each side sets, the first the base of the ratios; the default sets nothing.
SIDES: dict[str, dict[str, str]] = {
    "former": {"KB_EMBEDDING_INTRA_OP_THREADS": "2", "KB_EMBEDDING_RUNS_PER_REQUEST": "1"},
    "default": {},
}
FIGURES = (
    "docs_per_second",
    "docs_per_second_steady",
    "indexer_cpu_ms_per_document",
    "indexer_steady_cpu_ms_per_document",
)


def in_turn(sides: dict[str, dict[str, str]], round_: int) -> list[str]:
    """The sides in this round's order: none always first."""
    names = list(sides)
    shift = round_ % len(names)
    return names[shift:] + names[:shift]


def over_first(runs: dict[str, list[float]]) -> dict[str, float]:
    """Each side's median over the first side's."""
    base = statistics.median(next(iter(runs.values())))
    return {side: statistics.median(values) / base for side, values in runs.items()}


async def index_once(
    url: str, documents: list[bytes], media_type: str, side: dict[str, str]
) -> Any:
    await publish(url, documents, media_type)
    # run_indexer's provider URL is the bench server's; the offline model ignores it.
    settings = {"KB_EMBEDDING_PROVIDER": "onnx-local", **side}
    run = await run_indexer(url, "http://127.0.0.1:9", len(documents), 900, None, settings)
    if run["succeeded"] != len(documents):
        raise SystemExit(f"{side}: {run['succeeded']} of {len(documents)} documents indexed")
    run["docs_per_second"] = run["succeeded"] / run["seconds"]
    run["docs_per_second_steady"] = run["succeeded"] / (
        run["seconds"] - (run["first_claim_seconds"] or 0.0)
    )
    return {name: run[name] for name in FIGURES}


def bare_child(texts: int, batch_size: int, vectors: str) -> None:
    """The bare embedder the environment's settings build, in this process: its rate and
    peak memory on stdout."""
    from services.embedding.batching import embed_batched
    from services.embedding.factory import build_embedder
    from services.embedding.onnx_local import OnnxLocalEmbedder
    from services.embedding.settings import load_embedding_settings

    embedder = build_embedder(load_embedding_settings())
    assert isinstance(embedder, OnnxLocalEmbedder)
    inputs = make_texts(texts, lambda r: r.randint(20, 256), 3)
    asyncio.run(embed_batched(embedder, inputs[:batch_size], batch_size=batch_size))  # warm
    began = time.perf_counter()
    out = asyncio.run(embed_batched(embedder, inputs, batch_size=batch_size))
    seconds = time.perf_counter() - began
    np.save(vectors, out)
    plan = embedder.plan
    print(
        json.dumps(
            {
                "inputs_per_second": len(inputs) / seconds,
                "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "plan": [plan.intra_op_threads, plan.runs_per_request],
            }
        )
    )


def bare(sides: dict[str, dict[str, str]], rounds: int, texts: int, batch: int) -> Any:
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
    files = {side: f"/tmp/kb_bench_offline_{os.getpid()}_{side}.npy" for side in sides}
    base = {k: v for k, v in os.environ.items() if not k.startswith("KB_")}
    for round_ in range(rounds):
        for side in in_turn(sides, round_):
            child = subprocess.run(
                [sys.executable, "-m", "bench.offline_default", "--bare-child", "--texts",
                 str(texts), "--batch-size", str(batch), "--vectors", files[side]],
                env={**base, "KB_EMBEDDING_PROVIDER": "onnx-local", **sides[side]},
                capture_output=True, text=True, check=True,
            )  # fmt: skip
            runs[side].append(json.loads(child.stdout.splitlines()[-1]))
    vectors = {side: np.load(path) for side, path in files.items()}
    for path in files.values():
        os.unlink(path)
    first = next(iter(vectors.values()))
    rates = {side: [run["inputs_per_second"] for run in runs[side]] for side in sides}
    return {
        "inputs_per_second": rates,
        "over_first": over_first(rates),
        "peak_rss_mib": {side: max(run["peak_rss_mib"] for run in runs[side]) for side in sides},
        "plan_threads_runs": {side: runs[side][0]["plan"] for side in sides},
        "max_abs_difference": max(float(np.abs(v - first).max()) for v in vectors.values()),
    }


async def indexing(args: argparse.Namespace, sides: dict[str, dict[str, str]]) -> Any:
    admin_url = os.environ.get("DATABASE_URL")
    if not admin_url:
        raise SystemExit('DATABASE_URL is needed (eval "$(uv run kb dev up)")')
    documents = corpus(args.corpus, args.documents)
    runs: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
    for round_ in range(args.rounds):
        for side in in_turn(sides, round_):
            url = await recreate(admin_url, BENCH_DB)
            media_type = MEDIA_TYPES[args.corpus]
            runs[side].append(await index_once(url, documents, media_type, sides[side]))
    figures = {
        name: {side: [run[name] for run in runs[side]] for side in sides} for name in FIGURES
    }
    return {
        "documents": len(documents),
        "corpus": args.corpus,
        **figures,
        "over_first": {name: over_first(figures[name]) for name in FIGURES},
    }


def side(text: str) -> tuple[str, dict[str, str]]:
    name, _, variables = text.partition(":")
    return name, dict(item.split("=", 1) for item in variables.split(",") if item)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--documents", type=int, default=300)
    parser.add_argument("--corpus", choices=sorted(MEDIA_TYPES), default="markdown-notes")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--texts", type=int, default=512, help="the bare embedder's inputs")
    parser.add_argument("--batch-size", type=int, default=32, help="texts per request")
    parser.add_argument("--side", type=side, action="append", default=[], help="another side")
    parser.add_argument("--skip-indexer", action="store_true", help="the bare embedder alone")
    parser.add_argument("--skip-bare", action="store_true", help="the indexer alone")
    parser.add_argument("--bare-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--vectors", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bare_child:
        bare_child(args.texts, args.batch_size, args.vectors)
        return
    sides = {**SIDES, **dict(args.side)}
    result: dict[str, Any] = {"sides": sides, "rounds": args.rounds}
    if not args.skip_bare:
        result["bare"] = bare(sides, args.rounds, args.texts, args.batch_size)
    if not args.skip_indexer:
        result["indexing"] = asyncio.run(indexing(args, sides))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
