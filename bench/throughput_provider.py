"""An OpenAI-compatible embedding server for the throughput bench that counts what it is sent.

    uv run python -m bench.throughput_provider --port P --model onnx|hashing [--inference-batch N]
        [--model-threads T --runs-at-once R]

``POST /v1/embeddings`` embeds with the shipped int8 all-MiniLM-L6-v2 (``onnx``, each request's
texts sorted by token length, then run through the model ``--inference-batch`` at a time;
``--inference-batch 1``, one input per model run, is its fastest setting on 2 cores and the
one ``bench.langchain_peer`` runs both sides with) or the hashing stand-in
(``hashing``: pipeline overhead only). ``GET /stats`` reports requests, inputs and the
seconds spent inside the model (its busy time), ``GET /inputs`` every text it was sent;
``POST /stats/reset`` zeroes them. One
request is embedded at a time, as one model on one machine serves them: by default in one
model run at a time on two intra-op threads; with ``--runs-at-once 2 --model-threads 1`` a
request's inputs are shared out, alternately, between two runs at once of one thread each,
which keeps both cores busy when some other process takes one of them for a moment (two
threads of one run wait for each other at every step).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import numpy as np
from fastapi import FastAPI
from pydantic import BaseModel

from services.embedding.hashing import HashingEmbedder
from services.embedding.openai_wire import encoded_vector
from services.embedding.port import Embedder


class EmbeddingRequest(BaseModel):
    input: str | list[str]
    model: str
    encoding_format: str | None = None
    dimensions: int | None = None


def build_model(kind: str, inference_batch: int, threads: int = 2, runs: int = 1) -> Embedder:
    if kind == "hashing":
        return HashingEmbedder(384)
    from services.embedding.onnx_local import OnnxLocalEmbedder

    return OnnxLocalEmbedder(
        inference_batch_size=inference_batch,
        intra_op_threads=threads,
        max_concurrent_inferences=runs,
        # The server shares a request out itself (embed_in_runs): one run a call.
        runs_per_request=1,
    )


async def embed_in_runs(model: Embedder, texts: list[str], runs: int) -> Any:
    """``texts`` through ``runs`` model runs at once, each taking every ``runs``-th text."""
    if runs == 1 or len(texts) < 2:
        return await model.embed(texts)
    shares = [texts[start::runs] for start in range(runs)]
    results = await asyncio.gather(*(model.embed(share) for share in shares if share))
    out = np.empty((len(texts), results[0].shape[1]), dtype=np.float32)
    for start, vectors in enumerate(results):
        out[start::runs] = vectors
    return out


def create_app(model: Embedder, runs: int = 1) -> FastAPI:
    app = FastAPI(title="kb throughput bench provider")
    stats: dict[str, float] = {"requests": 0, "inputs": 0, "busy_seconds": 0.0}
    # Every input, in the order sent: the bench embeds the same texts with the bare model.
    received: list[str] = []
    one_at_a_time = asyncio.Lock()

    @app.get("/stats")
    async def read_stats() -> dict[str, Any]:
        return {"model": model.model, **stats}

    @app.post("/stats/reset")
    async def reset() -> dict[str, Any]:
        stats.update(requests=0, inputs=0, busy_seconds=0.0)
        received.clear()
        return {"model": model.model, **stats}

    @app.get("/inputs")
    async def inputs() -> list[str]:
        return received

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest) -> dict[str, Any]:
        texts = [body.input] if isinstance(body.input, str) else body.input
        async with one_at_a_time:
            started = time.perf_counter()
            vectors = await embed_in_runs(model, texts, runs)
            stats["busy_seconds"] += time.perf_counter() - started
        stats["requests"] += 1
        stats["inputs"] += len(texts)
        received.extend(texts)
        return {
            "object": "list",
            "model": body.model,
            "data": [
                {
                    "object": "embedding",
                    "index": i,
                    "embedding": encoded_vector(row, body.encoding_format),
                }
                for i, row in enumerate(vectors)
            ],
            "usage": {"prompt_tokens": 0, "total_tokens": 0},
        }

    return app


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", choices=["onnx", "hashing"], default="onnx")
    parser.add_argument("--inference-batch", type=int, default=8)
    parser.add_argument("--model-threads", type=int, default=2, help="intra-op threads a run")
    parser.add_argument("--runs-at-once", type=int, default=1, help="model runs a request shares")
    args = parser.parse_args()
    model = build_model(args.model, args.inference_batch, args.model_threads, args.runs_at_once)
    app = create_app(model, args.runs_at_once)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
