"""The guard in tests/conftest.py: a test that reaches the real PostgreSQL or Kafka without the
`integration` mark fails before any server starts, whether it names a server fixture or asks
for one on the fly; an e2e test that uses the servers counts as integration.

Each case runs in a pytest session of its own on that conftest, with the servers pointed at
closed ports: were a server ever asked for, the run would fail for another reason."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

INI = """
[pytest]
asyncio_mode = auto
asyncio_default_fixture_loop_scope = session
asyncio_default_test_loop_scope = session
markers =
    integration: needs the real PostgreSQL and Kafka
    e2e: starts the kb processes as a user would
"""

TESTS = """
import pytest


def test_free() -> None:
    pass


def test_names_a_server_fixture(conn) -> None:
    pass


@pytest.fixture
def asks_on_the_fly(request):
    return request.getfixturevalue("pool")


def test_asks_for_a_server_on_the_fly(asks_on_the_fly) -> None:
    pass


@pytest.fixture(params=["fake", pytest.param("real", marks=pytest.mark.integration)])
def backend(request):
    return None if request.param == "fake" else request.getfixturevalue("pool")


def test_contract(backend) -> None:
    assert backend is None


@pytest.mark.integration
def test_marked(conn) -> None:
    pass


@pytest.mark.e2e
def test_end_to_end(service_env) -> None:
    pass
"""


@pytest.fixture
def session_on_our_conftest(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATABASE_URL", "postgresql://nobody@127.0.0.1:1/none")
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:1")
    pytester.makeini(INI)
    pytester.makeconftest('pytest_plugins = ["tests.conftest"]\n')
    pytester.makepyfile(test_guarded=TESTS)


@pytest.mark.usefixtures("session_on_our_conftest")
def test_unmarked_server_tests_fail_and_no_server_is_asked_for(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-m", "not integration")
    result.assert_outcomes(passed=2, errors=2, deselected=3)
    result.stdout.fnmatch_lines_random(
        [
            "*test_names_a_server_fixture* uses fixture stack, template_database (the real"
            " PostgreSQL/Kafka) but is not marked `integration`*",
            "*test_asks_for_a_server_on_the_fly* uses a server fixture (the real"
            " PostgreSQL/Kafka) but is not marked `integration`*",
        ]
    )
    result.stdout.no_fnmatch_line("*127.0.0.1*")


@pytest.mark.usefixtures("session_on_our_conftest")
def test_integration_selects_marked_params_and_e2e_tests_on_the_servers(
    pytester: pytest.Pytester,
) -> None:
    result = pytester.runpytest_inprocess(
        "-p", "no:cacheprovider", "-m", "integration", "--collect-only", "-q"
    )
    result.stdout.fnmatch_lines_random(
        [
            "test_guarded.py::test_contract[[]real[]]",
            "test_guarded.py::test_marked",
            "test_guarded.py::test_end_to_end",
            "3/7 tests collected (4 deselected)*",
        ]
    )
