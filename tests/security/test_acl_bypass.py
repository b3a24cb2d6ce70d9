"""Principals that try to read around the ACL (issue 29): empty, wildcard-like, case and
Unicode look-alikes, SQL and JSON metacharacters, 1,000 of them. Search answers only the
documents whose ACL names one of the principals exactly (after NFC and trimming), and
never a 5xx."""

from __future__ import annotations

import pytest

from tests.security.test_auth_matrix import assert_no_leak
from tests.security.world import World

pytestmark = pytest.mark.integration

ATTEMPTS: dict[str, list[str]] = {
    "empty list": [],
    "star": ["*"],
    "percent": ["%"],
    "like pattern": ["group:%"],
    "underscore": ["group:suppor_"],
    "regex": [".*"],
    "upper case": ["GROUP:SUPPORT"],
    "cyrillic look-alike": ["group:suppоrt"],  # noqa: RUF001 (the o is Cyrillic)
    "fullwidth": ["ｇｒｏｕｐ:support"],  # noqa: RUF001
    "sql quote": ["' OR '1'='1"],
    "sql comment": ["group:support' --"],
    "sql array": ["{group:support}"],
    "json object": ['{"$ne": null}'],
    "json array": ['["group:support"]'],
    "backslash": ["group:support\\"],
    "comma list": ["group:hr,group:support"],
    "1000 strangers": [f"nobody:{i}" for i in range(1000)],
}


@pytest.mark.parametrize("attempt", list(ATTEMPTS))
async def test_no_principal_reads_around_the_acl(world: World, attempt: str) -> None:
    principals = ATTEMPTS[attempt]
    response = await world.search(
        world.acme.caller("search"), {"principals": principals, "topK": 100}
    )
    assert response.status_code == 200, response.text
    found = {hit["documentId"] for hit in response.json()["results"]}
    # Exactly what an ACL naming the principal as written grants: "*" reads the one document
    # whose ACL names "*", nothing else.
    assert found == {str(d) for d in world.acme.readable_by(principals)}
    readable_texts = {d.text for d in world.acme.documents if str(d.document_id) in found}
    for secret in world.secrets:
        if secret not in readable_texts:
            assert secret not in response.text


async def test_a_caller_principal_reads_what_its_acl_grants(world: World) -> None:
    # The control: the attempts above fail for their principals, not for the search.
    response = await world.search(world.acme.caller("search"), {"principals": ["group:support"]})
    found = {hit["documentId"] for hit in response.json()["results"]}
    assert found == {str(d) for d in world.acme.readable_by(["group:support"])} != set()


@pytest.mark.parametrize(
    "principals",
    [
        [f"g:{i}" for i in range(1001)],
        ["a" * 201],
        ["group:support\x00"],
        ["group:\u200bsupport"],  # hidden characters: 422 PRINCIPAL_INVALID (issue 41)
        [""],
        [1],
        "group:support",
        None,
    ],
)
async def test_unusable_principals_are_refused_before_search(
    world: World, principals: object
) -> None:
    response = await world.search(world.acme.caller("search"), {"principals": principals})
    assert response.status_code in {413, 422}, response.text
    assert_no_leak(world, response)
