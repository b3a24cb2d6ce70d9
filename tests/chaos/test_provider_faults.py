"""The demo provider's fault controls, which the chaos run switches at runtime."""

from __future__ import annotations

import httpx

from kbtools.demo.provider import create_provider_app
from services.embedding.hashing import HashingEmbedder


async def test_a_fault_answers_every_request_while_it_lasts() -> None:
    app = create_provider_app(HashingEmbedder())
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://provider") as client:
        body = {"input": ["harbour ledger"], "model": "hashing-v1-384"}
        fine = await client.post("/v1/embeddings", json=body)
        assert fine.status_code == 200
        assert len(fine.json()["data"][0]["embedding"]) == 384

        fault = {"kind": "rate_limit", "seconds": 60, "retry_after_seconds": 3}
        await client.post("/_control/fault", json=fault)
        limited = await client.post("/v1/embeddings", json=body)
        assert limited.status_code == 429
        assert limited.headers["Retry-After"] == "3"

        await client.post("/_control/fault", json={"kind": "malformed", "seconds": 60})
        malformed = await client.post("/v1/embeddings", json=body)
        assert malformed.status_code == 200
        assert not isinstance(malformed.json()["data"], list)

        await client.post("/_control/fault", json={"kind": "server_error", "seconds": 0})
        assert (await client.post("/v1/embeddings", json=body)).status_code == 200

        other = {"input": "harbour", "model": "hashing-v1-256"}
        second = (await client.post("/v1/embeddings", json=other)).json()
        assert second["model"] == "hashing-v1-256"
        assert len(second["data"][0]["embedding"]) == 256
        unknown = await client.post("/v1/embeddings", json={"input": "x", "model": "gpt-x"})
        assert unknown.status_code == 404
