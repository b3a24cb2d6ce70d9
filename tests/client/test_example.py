"""The example an application starts from (examples/rag/refund_policy.py, issue 45) runs
against the real server: it publishes the refund policy, waits until it is searchable, and
kb-client, LangChain and LlamaIndex each answer the question with the same passages, its
return window among them."""

from __future__ import annotations

import asyncio
import importlib.util
from typing import Any

import pytest

from tests.support.api import ApiTenant
from tests.support.stack import REPO_ROOT

pytestmark = pytest.mark.integration

EXAMPLE = REPO_ROOT / "examples" / "rag" / "refund_policy.py"


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("refund_policy_example", EXAMPLE)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def test_the_example_retrieves_the_return_window_through_each_framework(
    server: str, indexer: None, tenant: ApiTenant
) -> None:
    context = await asyncio.to_thread(_example().run, server, tenant.key)
    assert set(context) == {"kb-client", "langchain", "llamaindex"}
    # The same three passages each way (the hashing embedder of the tests ranks them by
    # shared words, so the order is not asserted), the return window among them.
    assert context["langchain"] == context["kb-client"]
    assert context["llamaindex"] == context["kb-client"]
    assert len(context["kb-client"]) == 3
    assert any(
        p.startswith("Refund policy > Return window") and "30 days" in p
        for p in context["kb-client"]
    ), context
