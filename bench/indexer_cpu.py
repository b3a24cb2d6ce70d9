"""The indexer's own CPU per document, one commit's code against another's, in one run.

    uv run python -m bench.indexer_cpu --before main --rounds 3
    uv run python -m bench.indexer_cpu --before main --rounds 3 --log-level info

Each side is a commit's code (``git archive`` into a scratch folder), run by this
environment's interpreter with PYTHONPATH on that folder: the same libraries, only our
code differs. One corpus (``--corpus``, default ``markdown-notes``: LangChain's benchmark
corpus's shape) is published once into a template database; each run indexes a fresh copy
of it with one `kb indexer run` (default settings, ``--log-level`` as KB_LOG_LEVEL) whose
provider is the hashing stand-in behind the OpenAI-compatible server
(``bench.indexing_throughput``'s), so the pipeline's own work is what is measured. The
sides alternate, each round in the other order.

Per run: the indexer process's CPU from its first claim to its last completion per
document (its parse processes included, from /proc), PostgreSQL's backends' CPU per
document, and docs/s from the first claim; per side, the median of its rounds. CPU time
moves far less than a rate with the machine's load, but does move: compare the sides of
one run only. Both sides must share the migrations (the template is this tree's).

Needs DATABASE_URL (or the dev stack: `kb dev up`). Not part of the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import statistics
import subprocess
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from bench.databases import drop_database, recreate_database
from bench.indexing_throughput import MEDIA_TYPES, corpus, publish, run_indexer, start_provider
from bench.pipeline import recreate

TEMPLATE_DB = "kb_bench_cpu_template"
RUN_DB = "kb_bench_cpu_run"
REPO = Path(__file__).resolve().parent.parent


def checkout(commit: str, into: Path) -> Path:
    """``commit``'s tree, unpacked under ``into``."""
    archive = subprocess.run(
        ["git", "archive", "--format=tar", commit], cwd=REPO, check=True, capture_output=True
    ).stdout
    folder = into / commit.replace("/", "_")
    folder.mkdir()
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(folder, filter="data")
    return folder


def same_migrations(commits: list[str]) -> bool:
    trees = {
        subprocess.run(
            ["git", "rev-parse", f"{commit}:migrations"],
            cwd=REPO,
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        for commit in commits
    }
    return len(trees) == 1


async def copy_of_template(admin_url: str) -> str:
    return await recreate_database(admin_url, RUN_DB, template=TEMPLATE_DB)


async def one_run(admin_url: str, code: Path, count: int, log_level: str) -> dict[str, Any]:
    url = await copy_of_template(admin_url)
    provider, base = start_provider("hashing", 8)
    previous = os.environ.get("PYTHONPATH")
    # The indexer process inherits it (indexer_env keeps every variable but KB_*).
    os.environ["PYTHONPATH"] = str(code)
    try:
        return await run_indexer(url, base, count, 600, None, {"KB_LOG_LEVEL": log_level})
    finally:
        if previous is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = previous
        provider.terminate()
        provider.wait(timeout=30)


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    admin_url = os.environ.get("DATABASE_URL")
    if not admin_url:
        raise SystemExit('DATABASE_URL is needed (eval "$(uv run kb dev up)")')
    sides = [args.before, args.after]
    if not same_migrations(sides):
        raise SystemExit("the two commits' migrations differ: compare them another way")
    documents = corpus(args.corpus, args.documents)
    url = await recreate(admin_url, TEMPLATE_DB)
    await publish(url, documents, MEDIA_TYPES[args.corpus])
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
    with tempfile.TemporaryDirectory(prefix="kb-cpu-") as scratch:
        code = {side: checkout(side, Path(scratch)) for side in sides}
        for number in range(args.rounds):
            for side in sides if number % 2 == 0 else sides[::-1]:
                run = await one_run(admin_url, code[side], len(documents), args.log_level)
                if run["succeeded"] != len(documents):
                    raise SystemExit(f"{side}: {run['succeeded']} of {len(documents)} indexed")
                runs[side].append(
                    {
                        "indexer_cpu_ms": run["indexer_steady_cpu_ms_per_document"],
                        "postgres_cpu_ms": run["postgres_cpu_ms_per_document"],
                        "docs_per_second": len(documents)
                        / max(1e-9, run["seconds"] - (run["first_claim_seconds"] or 0.0)),
                    }
                )
    await drop_database(admin_url, RUN_DB)
    await drop_database(admin_url, TEMPLATE_DB)

    def median(side: str, key: str) -> float:
        return float(statistics.median(run[key] for run in runs[side]))

    before, after = sides
    return {
        "corpus": args.corpus,
        "documents": len(documents),
        "log_level": args.log_level,
        "rounds": runs,
        "median_indexer_cpu_ms": {side: median(side, "indexer_cpu_ms") for side in sides},
        "indexer_cpu_after_over_before": median(after, "indexer_cpu_ms")
        / median(before, "indexer_cpu_ms"),
        "median_docs_per_second": {side: median(side, "docs_per_second") for side in sides},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--before", required=True, help="a commit (branch, tag, hash)")
    parser.add_argument("--after", default="HEAD", help="a commit (default HEAD)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--documents", type=int, default=2000)
    parser.add_argument("--corpus", choices=sorted(MEDIA_TYPES), default="markdown-notes")
    parser.add_argument("--log-level", choices=["warning", "info"], default="warning")
    args = parser.parse_args()
    print(json.dumps(asyncio.run(measure(args)), indent=2))


if __name__ == "__main__":
    main()
