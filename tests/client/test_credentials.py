"""No credential leaves kb-client but in the Authorization header it sends (issue 45): not in
a client's, a key's or a request body's repr, not in a log line of the client or of httpx /
httpcore at DEBUG, not in an exception's message, repr or formatted traceback -- for answers
that succeed, are refused (a wrong key, a forged principal token) or never come."""

from __future__ import annotations

import logging
import traceback
import uuid

import pytest
from kb_client import ApiKey, AsyncKbClient, KbClient, KbClientError, ProblemError, RetryPolicy
from kb_client.models import SearchBody

from tests.support.api import ApiTenant, free_port

pytestmark = pytest.mark.integration

READ = ["group:all"]
# Shaped like a JWT, as a principal token is.
TOKEN = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJhbm4ifQ." + uuid.uuid4().hex


def _secrets(key: str) -> list[str]:
    return [key, key.rsplit(".", 1)[-1], TOKEN, TOKEN.rsplit(".", 1)[-1]]


def _shown(error: BaseException) -> str:
    return "\n".join(
        [str(error), repr(error), *traceback.format_exception(error), repr(error.__dict__)]
    )


async def test_no_credential_in_reprs_logs_or_errors(
    server: str, tenant: ApiTenant, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    wrong = f"kb.{tenant.tenant_id}.{uuid.uuid4().hex}"
    shown: list[str] = []
    async with AsyncKbClient(server, tenant.key) as kb:
        shown += [repr(kb), str(kb), repr(kb._key), str(ApiKey(tenant.key))]
        shown.append(repr(await kb.search("refund", principals=READ)))
        # A principal token that does not verify: 401, and the token is not in the error.
        with pytest.raises(ProblemError) as forged:
            await kb.search("refund", principal_token=TOKEN)
        shown.append(_shown(forged.value))
        shown.append(repr(SearchBody(query="q", principal_token=TOKEN)))
    async with AsyncKbClient(server, wrong) as kb:
        with pytest.raises(ProblemError) as refused:
            await kb.search("refund", principals=READ)
        shown.append(_shown(refused.value))
    policy = RetryPolicy(max_attempts=2, base_delay=0.01)
    with KbClient(f"http://127.0.0.1:{free_port()}", tenant.key, retry=policy) as dead:
        with pytest.raises(KbClientError) as unreachable:
            dead.search("refund", principal_token=TOKEN)
        shown.append(_shown(unreachable.value))
    assert forged.value.code == "PRINCIPAL_TOKEN_INVALID"
    assert refused.value.code
    shown.append(caplog.text)
    assert any("HTTP Request" in r.getMessage() for r in caplog.records), "httpx did not log"
    everything = "\n".join(shown)
    for secret in _secrets(tenant.key) + _secrets(wrong):
        assert secret not in everything
