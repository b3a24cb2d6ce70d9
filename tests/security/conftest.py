"""The security suite's fixtures: one database and one composed app per module
(tests/security/world.py), so the many small requests of a module share their set-up."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.security.world import World, world_app, world_data_in
from tests.support.api import UNTHROTTLED


@pytest.fixture(scope="module")
async def world(module_database: str) -> AsyncIterator[World]:
    acme, globex, operator_key, signing = await world_data_in(module_database)
    secrets = [operator_key, signing.hmac_secret]
    for tenant in (acme, globex):
        secrets += [key for _, key in tenant.keys.values()]
        secrets += [d.text for d in tenant.documents]
    # The matrix and the bypass attempts send hundreds of refused requests from one address:
    # the failed-key throttle (test_failed_auth_throttle.py) must not answer them 429 before
    # the check under test is reached.
    async with world_app(module_database, UNTHROTTLED) as (app, client, pool):
        yield World(app, client, pool, acme, globex, operator_key, signing, secrets)
