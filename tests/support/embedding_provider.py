"""Our own OpenAI-compatible embedding provider for tests and the demo, with fault injection.

It speaks ``POST /v1/embeddings`` ({input: str | [str], model, dimensions?, encoding_format?}
-> {object: "list", data: [{object: "embedding", index, embedding}], model, usage}) over real
HTTP and embeds with the deterministic HashingEmbedder, echoing the requested model name.

Use it
- in process: ``provider.transport()`` (httpx.ASGITransport) with base URL ``IN_PROCESS_URL``;
- on a real port in a background thread: ``with served_provider() as served: served.base_url``;
- as a process: ``python -m tests.support.embedding_provider [--port 0]`` prints
  ``KB_EMBEDDING_BASE_URL=http://127.0.0.1:PORT/v1`` and serves until SIGTERM
  (``start_provider_process()`` does this and hands back a ``ProviderControl``).

Faults (``provider.inject(kind, ...)`` or ``POST /_control/faults``) apply to the next
``times`` requests, or for ``for_seconds``, or until cleared; ``match`` limits one to requests
with an input containing that text. Every request is recorded (inputs, model, dimensions,
encoding, whether it carried a key, the fault applied) for tests that check batching.

A quota (``provider.set_quota(...)`` or ``PUT /_control/quota``) meters requests and tokens
per minute as a hosted provider does, per key: a token bucket refilled continuously, holding
``burst_seconds`` of the rate. A request beyond it is answered 429 with the whole seconds
until it would fit as Retry-After, and costs nothing. ``GET /_control/stats`` counts answers
by status, with the tokens answered (counted as the client's approximate tokenizer counts).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import math
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any, Literal

import httpx
import numpy as np
import uvicorn
from fastapi import FastAPI, Request, Response
from pydantic import BaseModel, Field

from services.embedding.hashing import HashingEmbedder
from services.embedding.tokens import approximate_tokens

IN_PROCESS_URL = "http://embedding-provider.test/v1"

FaultKind = Literal[
    "rate_limit",  # 429 with Retry-After (retry_after: "2" or an HTTP date)
    "status",  # any status (default 503), Retry-After if given
    "delay",  # answer correctly after delay_seconds
    "hang",  # answer only after hang_seconds (or when faults are cleared): past any timeout
    "wrong_count",  # one embedding fewer than inputs
    "duplicate_index",  # the last item repeats the first index
    "missing_index",  # indices 1..n instead of 0..n-1
    "wrong_dimension",  # every vector one value short
    "nan",  # NaN inside the first vector
    "model_changed",  # answers with another model name (model, default "<model>-v2")
    "bad_request",  # 400 for the whole request
    "not_json",  # 200 with a body that is not JSON
    "shuffled",  # a correct answer with the data items in reverse order
]


class Fault(BaseModel):
    kind: FaultKind
    times: int | None = Field(default=None, ge=1)
    for_seconds: float | None = Field(default=None, gt=0)
    match: str | None = None
    status: int = Field(default=503, ge=400, le=599)
    retry_after: str | None = None
    delay_seconds: float = Field(default=0.0, ge=0)
    hang_seconds: float = Field(default=60.0, ge=0)
    model: str | None = None


class Limits(BaseModel):
    # Inputs longer than this many characters are refused with 400, like a model's context.
    max_input_chars: int | None = Field(default=None, ge=1)


class Quota(BaseModel):
    requests_per_minute: float | None = Field(default=None, gt=0)
    tokens_per_minute: float | None = Field(default=None, gt=0)
    # How much of a minute's quota may be spent at once (the bucket's size, in seconds).
    burst_seconds: float = Field(default=1.0, gt=0)


class _QuotaBuckets:
    """Two token buckets (requests, tokens), refilled continuously; a request takes from
    both or from neither."""

    def __init__(self, quota: Quota, now: float) -> None:
        self.quota = quota
        self._levels = {
            name: self._capacity(rate) for name, rate in self._rates().items() if rate is not None
        }
        self._at = now

    def _rates(self) -> dict[str, float | None]:
        return {"requests": self.quota.requests_per_minute, "tokens": self.quota.tokens_per_minute}

    def _capacity(self, per_minute: float) -> float:
        return max(1.0, per_minute / 60.0 * self.quota.burst_seconds)

    def take(self, requests: int, tokens: int, now: float) -> float | None:
        """None when the request fits (and is charged), else seconds until it would."""
        costs = {"requests": float(requests), "tokens": float(tokens)}
        rates = self._rates()
        elapsed = max(0.0, now - self._at)
        self._at = now
        wait = 0.0
        for name in self._levels:
            per_minute = rates[name]
            assert per_minute is not None
            per_second = per_minute / 60.0
            capacity = self._capacity(per_minute)
            self._levels[name] = min(capacity, self._levels[name] + elapsed * per_second)
            # A request bigger than the bucket is admitted when the bucket is full.
            cost = min(costs[name], capacity)
            if self._levels[name] < cost:
                wait = max(wait, (cost - self._levels[name]) / per_second)
        if wait > 0:
            return wait
        for name in self._levels:
            capacity = self._capacity(rates[name] or 1.0)
            self._levels[name] -= min(costs[name], capacity)
        return None


@dataclass(frozen=True)
class RecordedRequest:
    inputs: tuple[str, ...]
    model: str
    dimensions: int | None
    encoding_format: str
    authorized: bool
    fault: str | None


@dataclass
class _ActiveFault:
    fault: Fault
    remaining: int | None
    until: float | None

    def live(self, now: float) -> bool:
        return (self.remaining is None or self.remaining > 0) and (
            self.until is None or now < self.until
        )


def _json(status: int, body: Any, headers: dict[str, str] | None = None) -> Response:
    # allow_nan: the "nan" fault must reach the client as the JSON token NaN.
    return Response(
        json.dumps(body, allow_nan=True),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    kind = "rate_limit_exceeded" if status == 429 else "invalid_request_error"
    return _json(status, {"error": {"message": message, "type": kind}}, headers)


class EmbeddingProvider:
    def __init__(
        self,
        *,
        dimension: int = 384,
        api_key: str | None = None,
        max_input_chars: int | None = None,
    ) -> None:
        self.dimension = dimension
        self.api_key = api_key
        self._lock = threading.Lock()
        self._faults: list[_ActiveFault] = []
        self._requests: list[RecordedRequest] = []
        self._limits = Limits(max_input_chars=max_input_chars)
        self._quota: _QuotaBuckets | None = None
        self._answered: dict[int, int] = {}
        self._tokens_answered = 0
        self._hanging: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()
        self.app = self._build_app()

    # --- control (in process) -------------------------------------------------------------

    def inject(self, kind: FaultKind, **fields: Any) -> Fault:
        fault = Fault(kind=kind, **fields)
        self.add_fault(fault)
        return fault

    def add_fault(self, fault: Fault) -> None:
        until = time.monotonic() + fault.for_seconds if fault.for_seconds else None
        with self._lock:
            self._faults.append(_ActiveFault(fault, fault.times, until))

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()
            hanging = list(self._hanging)
        # Requests hanging now answer at once; control calls may come from any thread.
        for loop, released in hanging:
            with contextlib.suppress(RuntimeError):  # that loop is already closed
                loop.call_soon_threadsafe(released.set)

    def set_limits(self, limits: Limits) -> None:
        with self._lock:
            self._limits = limits

    def set_quota(self, quota: Quota | None) -> None:
        """Meter requests from now on (None: no quota); the counts start again."""
        with self._lock:
            self._quota = _QuotaBuckets(quota, time.monotonic()) if quota else None
            self._answered.clear()
            self._tokens_answered = 0

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "answered": {str(status): count for status, count in self._answered.items()},
                "tokens_answered": self._tokens_answered,
            }

    def _count(self, status: int, tokens: int) -> None:
        with self._lock:
            self._answered[status] = self._answered.get(status, 0) + 1
            if status == 200:
                self._tokens_answered += tokens

    def _over_quota(self, inputs: list[str]) -> float | None:
        with self._lock:
            if self._quota is None:
                return None
            tokens = sum(approximate_tokens(text) for text in inputs)
            return self._quota.take(1, tokens, time.monotonic())

    @property
    def requests(self) -> list[RecordedRequest]:
        with self._lock:
            return list(self._requests)

    def clear_requests(self) -> None:
        with self._lock:
            self._requests.clear()

    def transport(self) -> httpx.ASGITransport:
        return httpx.ASGITransport(app=self.app)

    # --- serving ----------------------------------------------------------------------------

    def _take_fault(self, inputs: list[str]) -> Fault | None:
        now = time.monotonic()
        with self._lock:
            self._faults = [active for active in self._faults if active.live(now)]
            for active in self._faults:
                match = active.fault.match
                if match is None or any(match in text for text in inputs):
                    if active.remaining is not None:
                        active.remaining -= 1
                    return active.fault
        return None

    async def _hang(self, seconds: float) -> None:
        waiter = (asyncio.get_running_loop(), asyncio.Event())
        with self._lock:
            self._hanging.add(waiter)
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(waiter[1].wait(), seconds)
        finally:
            with self._lock:
                self._hanging.discard(waiter)

    async def _embeddings(self, request: Request) -> Response:
        response, tokens = await self._metered(request)
        self._count(response.status_code, tokens)
        return response

    async def _metered(self, request: Request) -> tuple[Response, int]:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "body is not JSON"), 0
        raw_input = body.get("input") if isinstance(body, dict) else None
        inputs = [raw_input] if isinstance(raw_input, str) else raw_input
        if isinstance(inputs, list) and all(isinstance(text, str) for text in inputs):
            wait = self._over_quota(inputs)
            if wait is not None:
                seconds = str(max(1, math.ceil(wait)))
                return _error(429, "Rate limit reached", {"Retry-After": seconds}), 0
            tokens = sum(approximate_tokens(text) for text in inputs)
        else:
            tokens = 0
        return await self._embeddings_unmetered(request), tokens

    async def _embeddings_unmetered(self, request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "body is not JSON")
        raw_input = body.get("input") if isinstance(body, dict) else None
        inputs = [raw_input] if isinstance(raw_input, str) else raw_input
        model = body.get("model") if isinstance(body, dict) else None
        if (
            not isinstance(inputs, list)
            or not inputs
            or not all(isinstance(text, str) for text in inputs)
            or not isinstance(model, str)
        ):
            return _error(
                400, "'input' must be a string or a non-empty list of strings, 'model' a string"
            )
        dimensions = body.get("dimensions")
        encoding_format = body.get("encoding_format") or "float"
        authorized = self.api_key is None or (
            request.headers.get("authorization") == f"Bearer {self.api_key}"
        )
        fault = self._take_fault(inputs)
        with self._lock:
            self._requests.append(
                RecordedRequest(
                    tuple(inputs),
                    model,
                    dimensions,
                    encoding_format,
                    authorized,
                    fault.kind if fault else None,
                )
            )
            limits = self._limits
        if not authorized:
            # Echoes what it got, as real providers half do: clients must scrub error bodies.
            presented = request.headers.get("authorization", "").removeprefix("Bearer ")
            return _error(401, f"Incorrect API key provided: {presented}")
        if encoding_format not in ("float", "base64"):
            return _error(400, f"unknown encoding_format {encoding_format!r}")
        if dimensions is not None and (not isinstance(dimensions, int) or dimensions < 1):
            return _error(400, "'dimensions' must be a positive integer")
        if limits.max_input_chars is not None:
            for position, text in enumerate(inputs):
                if len(text) > limits.max_input_chars:
                    return _error(
                        400,
                        f"input {position} is {len(text)} characters, this model reads at most "
                        f"{limits.max_input_chars}",
                    )
        return await self._answer(
            inputs, model, dimensions or self.dimension, encoding_format, fault
        )

    async def _answer(
        self,
        inputs: list[str],
        model: str,
        dimension: int,
        encoding_format: str,
        fault: Fault | None,
    ) -> Response:
        kind = fault.kind if fault else None
        if fault is not None:
            retry_headers = {"Retry-After": fault.retry_after} if fault.retry_after else None
            if kind == "rate_limit":
                return _error(429, "Rate limit reached for requests", retry_headers)
            if kind == "status":
                return _error(fault.status, f"injected {fault.status}", retry_headers)
            if kind == "bad_request":
                return _error(400, "injected bad request")
            if kind == "not_json":
                return Response("<html>gateway</html>", media_type="text/html")
            if kind == "delay":
                await asyncio.sleep(fault.delay_seconds)
            if kind == "hang":
                await self._hang(fault.hang_seconds)
        vectors = HashingEmbedder(dimension).embed_sync(inputs)
        if kind == "wrong_dimension":
            vectors = vectors[:, :-1]
        if kind == "nan":
            vectors[0, 0] = np.nan
        data: list[dict[str, Any]] = [
            {
                "object": "embedding",
                "index": index,
                "embedding": self._encode(vector, encoding_format),
            }
            for index, vector in enumerate(vectors)
        ]
        if kind == "wrong_count":
            data.pop()
        if kind == "duplicate_index" and len(data) > 1:
            data[-1]["index"] = data[0]["index"]
        if kind == "missing_index":
            for item in data:
                item["index"] += 1
        if kind == "shuffled":
            data.reverse()
        answered_model = model
        if kind == "model_changed":
            answered_model = fault.model if fault and fault.model else f"{model}-v2"
        tokens = sum(len(text.split()) for text in inputs)
        return _json(
            200,
            {
                "object": "list",
                "data": data,
                "model": answered_model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            },
        )

    @staticmethod
    def _encode(vector: np.ndarray[Any, Any], encoding_format: str) -> Any:
        if encoding_format == "base64":
            return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
        return [float(value) for value in vector]

    def _build_app(self) -> FastAPI:
        app = FastAPI(
            title="test embedding provider", openapi_url=None, docs_url=None, redoc_url=None
        )

        @app.post("/v1/embeddings")
        async def embeddings(request: Request) -> Response:
            return await self._embeddings(request)

        @app.post("/_control/faults")
        async def add_fault(fault: Fault) -> dict[str, int]:
            self.add_fault(fault)
            with self._lock:
                return {"faults": len(self._faults)}

        @app.delete("/_control/faults")
        async def clear_faults() -> dict[str, int]:
            self.clear_faults()
            return {"faults": 0}

        @app.put("/_control/limits")
        async def set_limits(limits: Limits) -> Limits:
            self.set_limits(limits)
            return limits

        @app.put("/_control/quota")
        async def set_quota(quota: Quota) -> Quota:
            self.set_quota(quota)
            return quota

        @app.delete("/_control/quota")
        async def clear_quota() -> dict[str, None]:
            self.set_quota(None)
            return {"quota": None}

        @app.get("/_control/stats")
        async def stats() -> dict[str, Any]:
            return self.stats()

        @app.get("/_control/requests")
        async def recorded() -> list[dict[str, Any]]:
            return [asdict(item) for item in self.requests]

        @app.delete("/_control/requests")
        async def clear_recorded() -> dict[str, int]:
            self.clear_requests()
            return {"requests": 0}

        return app


# --- a real port: in a background thread, or as a process ------------------------------------


class ProviderControl:
    """The control API of a provider served elsewhere (another thread or process)."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url  # ends in /v1, as KB_EMBEDDING_BASE_URL
        self._root = base_url.removesuffix("/v1")

    def inject(self, kind: FaultKind, **fields: Any) -> None:
        body = Fault(kind=kind, **fields).model_dump(exclude_none=True)
        httpx.post(f"{self._root}/_control/faults", json=body, timeout=10).raise_for_status()

    def clear_faults(self) -> None:
        httpx.delete(f"{self._root}/_control/faults", timeout=10).raise_for_status()

    def set_limits(self, *, max_input_chars: int | None) -> None:
        httpx.put(
            f"{self._root}/_control/limits", json={"max_input_chars": max_input_chars}, timeout=10
        ).raise_for_status()

    def set_quota(self, quota: Quota | None) -> None:
        if quota is None:
            httpx.delete(f"{self._root}/_control/quota", timeout=10).raise_for_status()
            return
        httpx.put(
            f"{self._root}/_control/quota", json=quota.model_dump(), timeout=10
        ).raise_for_status()

    def stats(self) -> dict[str, Any]:
        answer = httpx.get(f"{self._root}/_control/stats", timeout=10)
        answer.raise_for_status()
        result: dict[str, Any] = answer.json()
        return result

    def requests(self) -> list[RecordedRequest]:
        answer = httpx.get(f"{self._root}/_control/requests", timeout=10)
        answer.raise_for_status()
        return [
            RecordedRequest(**{**item, "inputs": tuple(item["inputs"])}) for item in answer.json()
        ]


def _listening_socket(port: int = 0) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    # Listening before the server loop runs: early clients wait in the backlog.
    sock.listen(128)
    return sock


def _server(provider: EmbeddingProvider) -> uvicorn.Server:
    config = uvicorn.Config(
        provider.app,
        log_level="warning",
        access_log=False,
        lifespan="off",
        ws="none",
        http="h11",
        timeout_graceful_shutdown=2,
    )
    return uvicorn.Server(config)


@dataclass
class ServedProvider:
    provider: EmbeddingProvider
    base_url: str
    control: ProviderControl
    _server: uvicorn.Server
    _thread: threading.Thread

    def stop(self) -> None:
        self.provider.clear_faults()
        self._server.should_exit = True
        self._thread.join(timeout=10)


def serve_in_thread(provider: EmbeddingProvider | None = None) -> ServedProvider:
    provider = provider or EmbeddingProvider()
    sock = _listening_socket()
    port = sock.getsockname()[1]
    server = _server(provider)
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="embedding-provider", daemon=True
    )
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("test embedding provider did not start")
        time.sleep(0.01)
    base_url = f"http://127.0.0.1:{port}/v1"
    return ServedProvider(provider, base_url, ProviderControl(base_url), server, thread)


@contextlib.contextmanager
def served_provider(provider: EmbeddingProvider | None = None) -> Iterator[ServedProvider]:
    served = serve_in_thread(provider)
    try:
        yield served
    finally:
        served.stop()


@dataclass
class ProviderProcess:
    process: subprocess.Popen[str]
    base_url: str
    control: ProviderControl

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)


def start_provider_process(
    *, dimension: int = 384, api_key: str | None = None, port: int = 0
) -> ProviderProcess:
    """``python -m tests.support.embedding_provider`` as a child process; stop() it."""
    command = [
        sys.executable,
        "-m",
        "tests.support.embedding_provider",
        "--port",
        str(port),
        "--dimension",
        str(dimension),
    ]
    env = dict(os.environ)
    if api_key is not None:
        # Through the environment, not argv: argv is visible in `ps`.
        env["TEST_EMBEDDING_PROVIDER_API_KEY"] = api_key
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)
    assert process.stdout is not None
    line = process.stdout.readline().strip()
    if not line.startswith("KB_EMBEDDING_BASE_URL="):
        process.kill()
        process.wait(timeout=10)
        raise RuntimeError(f"test embedding provider did not start: {line!r}")
    base_url = line.partition("=")[2]
    return ProviderProcess(process, base_url, ProviderControl(base_url))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--dimension", type=int, default=384)
    arguments = parser.parse_args()
    provider = EmbeddingProvider(
        dimension=arguments.dimension, api_key=os.environ.get("TEST_EMBEDDING_PROVIDER_API_KEY")
    )
    sock = _listening_socket(arguments.port)
    print(f"KB_EMBEDDING_BASE_URL=http://127.0.0.1:{sock.getsockname()[1]}/v1", flush=True)
    # uvicorn handles SIGTERM/SIGINT in the main thread: a graceful exit.
    _server(provider).run(sockets=[sock])


if __name__ == "__main__":
    main()
