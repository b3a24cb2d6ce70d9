"""The demo's embedding provider: an OpenAI-compatible ``/v1/embeddings`` endpoint over the
offline ONNX model, which can be told to rate-limit for a while (``POST /_control/throttle``)
or to fail in other ways (``POST /_control/fault``: 429 with Retry-After, a 5xx, a hang past
the client's timeout, a malformed body), for a while.

The demo's indexers reach the model through it, so the story can show a provider answering
429 with Retry-After while search keeps serving the previous version. It is a real HTTP
server on 127.0.0.1 (``python -m kbtools.demo.provider --port P``), not a mock.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from services.embedding.hashing import HashingEmbedder
from services.embedding.onnx_local import OnnxLocalEmbedder
from services.embedding.openai_wire import encoded_vector
from services.embedding.port import Embedder

FaultKind = Literal["rate_limit", "server_error", "hang", "malformed"]


class EmbeddingRequest(BaseModel):
    input: str | list[str]
    model: str
    encoding_format: str | None = None
    dimensions: int | None = None


class Throttle(BaseModel):
    seconds: float = Field(ge=0, le=600)
    retry_after_seconds: int = Field(default=1, ge=1, le=60)


class Fault(BaseModel):
    """Every request for ``seconds`` gets this fault (``hang``: holds the answer that long)."""

    kind: FaultKind
    seconds: float = Field(ge=0, le=600)
    retry_after_seconds: int = Field(default=1, ge=1, le=60)


def create_provider_app(embedder: Embedder | None = None, *, latency_s: float = 0.0) -> FastAPI:
    app = FastAPI(title="kb demo embedding provider")
    model = embedder or OnnxLocalEmbedder()
    state: dict[str, Any] = {
        "throttle_until": 0.0,
        "retry_after": 1,
        "requests": 0,
        "refused": 0,
        "fault": None,
        "fault_until": 0.0,
        "faulted": 0,
    }
    others: dict[str, Embedder] = {}

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"status": "ok", "model": model.model, **state}

    @app.post("/_control/throttle")
    async def throttle(body: Throttle) -> dict[str, Any]:
        state["throttle_until"] = time.monotonic() + body.seconds
        state["retry_after"] = body.retry_after_seconds
        return {"throttled_for_seconds": body.seconds}

    @app.post("/_control/fault")
    async def fault(body: Fault) -> dict[str, Any]:
        state["fault"] = body.model_dump()
        state["fault_until"] = time.monotonic() + body.seconds
        return {"fault": body.kind, "for_seconds": body.seconds}

    async def faulted() -> JSONResponse | None:
        current = state["fault"]
        if current is None or time.monotonic() >= state["fault_until"]:
            return None
        state["faulted"] += 1
        if current["kind"] == "rate_limit":
            return JSONResponse(
                {"error": {"message": "rate limited (injected)", "type": "rate_limit"}},
                status_code=429,
                headers={"Retry-After": str(current["retry_after_seconds"])},
            )
        if current["kind"] == "server_error":
            return JSONResponse({"error": {"message": "injected", "type": "server"}}, 503)
        if current["kind"] == "hang":
            await asyncio.sleep(max(0.0, state["fault_until"] - time.monotonic()))
            return JSONResponse({"error": {"message": "hung (injected)", "type": "server"}}, 504)
        return JSONResponse({"object": "list", "data": "not a list"}, 200)

    @app.post("/v1/embeddings", response_model=None)
    async def embeddings(body: EmbeddingRequest, request: Request) -> JSONResponse | dict[str, Any]:
        state["requests"] += 1
        injected = await faulted()
        if injected is not None:
            return injected
        if latency_s:
            await asyncio.sleep(latency_s)  # a remote provider's round trip
        if time.monotonic() < state["throttle_until"]:
            state["refused"] += 1
            return JSONResponse(
                {"error": {"message": "rate limited (demo throttle)", "type": "rate_limit"}},
                status_code=429,
                headers={"Retry-After": str(state["retry_after"])},
            )
        serving = _model_for(model, body.model, others)
        if serving is None:
            return JSONResponse(
                {"error": {"message": f"unknown model {body.model!r}", "type": "invalid"}},
                status_code=404,
            )
        texts = [body.input] if isinstance(body.input, str) else body.input
        vectors = await serving.embed(texts)
        return {
            "object": "list",
            "model": serving.model,
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


def _model_for(model: Embedder, name: str, others: dict[str, Embedder]) -> Embedder | None:
    """``model``, or for a hashing provider the hashing model of another dimension that
    ``name`` asks for (a second search generation needs a second model)."""
    if name == model.model:
        return model
    if not (isinstance(model, HashingEmbedder) and name.startswith("hashing-v1-")):
        return None
    if name not in others:
        try:
            others[name] = HashingEmbedder(int(name.removeprefix("hashing-v1-")))
        except ValueError:
            return None
    return others[name]


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument(
        "--embedder",
        choices=("onnx-local", "hashing"),
        default="onnx-local",
        help="hashing: the deterministic stand-in (model hashing-v1-384), cheap on a busy CPU",
    )
    parser.add_argument(
        "--latency", type=float, default=0.0, help="seconds added to every embedding answer"
    )
    args = parser.parse_args()
    embedder = HashingEmbedder() if args.embedder == "hashing" else None
    app = create_provider_app(embedder, latency_s=args.latency)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
