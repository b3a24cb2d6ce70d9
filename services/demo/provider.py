"""The demo's embedding provider: an OpenAI-compatible ``/v1/embeddings`` endpoint over the
offline ONNX model, which can be told to rate-limit for a while (``POST /_control/throttle``).

The demo's indexers reach the model through it, so the story can show a provider answering
429 with Retry-After while search keeps serving the previous version. It is a real HTTP
server on 127.0.0.1 (``python -m services.demo.provider --port P``), not a mock.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from services.embedding.onnx_local import OnnxLocalEmbedder


class EmbeddingRequest(BaseModel):
    input: str | list[str]
    model: str
    encoding_format: str | None = None
    dimensions: int | None = None


class Throttle(BaseModel):
    seconds: float = Field(ge=0, le=600)
    retry_after_seconds: int = Field(default=1, ge=1, le=60)


def create_provider_app(embedder: OnnxLocalEmbedder | None = None) -> FastAPI:
    app = FastAPI(title="kb demo embedding provider")
    model = embedder or OnnxLocalEmbedder()
    state: dict[str, Any] = {"throttle_until": 0.0, "retry_after": 1, "requests": 0, "refused": 0}

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"status": "ok", "model": model.model, **state}

    @app.post("/_control/throttle")
    async def throttle(body: Throttle) -> dict[str, Any]:
        state["throttle_until"] = time.monotonic() + body.seconds
        state["retry_after"] = body.retry_after_seconds
        return {"throttled_for_seconds": body.seconds}

    @app.post("/v1/embeddings", response_model=None)
    async def embeddings(body: EmbeddingRequest, request: Request) -> JSONResponse | dict[str, Any]:
        state["requests"] += 1
        if time.monotonic() < state["throttle_until"]:
            state["refused"] += 1
            return JSONResponse(
                {"error": {"message": "rate limited (demo throttle)", "type": "rate_limit"}},
                status_code=429,
                headers={"Retry-After": str(state["retry_after"])},
            )
        if body.model != model.model:
            return JSONResponse(
                {"error": {"message": f"unknown model {body.model!r}", "type": "invalid"}},
                status_code=404,
            )
        texts = [body.input] if isinstance(body.input, str) else body.input
        vectors = await model.embed(texts)
        return {
            "object": "list",
            "model": model.model,
            "data": [
                {"object": "embedding", "index": i, "embedding": [float(x) for x in row]}
                for i, row in enumerate(vectors)
            ],
            "usage": {"prompt_tokens": 0, "total_tokens": 0},
        }

    return app


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    uvicorn.run(create_provider_app(), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
