"""A PostgreSQL server of a test's own, which the test may restart (tests/e2e/test_pg_restart.py).

The shared server (the dev stack's, or ``DATABASE_URL``'s) is never restarted: other test
sessions use it. This one is an embedded PostgreSQL like the dev stack's, in
``KB_TEST_RESTART_HOME`` (default ``.kb/test-restart``) on a free port, stopped at the end.
A restart is PostgreSQL's fast shutdown (``pg_ctl -m fast``): every session is ended with
"terminating connection due to administrator command", new connections are refused until
the server is up again, as an operator's restart or a failover does to a running process.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kbtools.chaos.rig.ports import listen_port
from kbtools.devstack.postgres import EmbeddedPostgres
from kbtools.devstack.settings import DevStackSettings
from tests.support.stack import REPO_ROOT, Stack


@dataclass(frozen=True)
class RestartablePostgres:
    server: EmbeddedPostgres
    stack: Stack  # test databases are created on it as on the shared server

    def stop(self) -> None:
        """Fast shutdown: sessions end, connections are refused until ``start``."""
        self.server.down()

    def start(self) -> None:
        self.server.up()

    def restart(self) -> None:
        self.stop()
        self.start()


@contextmanager
def restartable_postgres(kafka_bootstrap: str) -> Iterator[RestartablePostgres]:
    home = Path(os.environ.get("KB_TEST_RESTART_HOME") or REPO_ROOT / ".kb" / "test-restart")
    # Below the ephemeral range: while the server is down, no client connection's local end
    # can take its port (it would fail to start again, "address already in use").
    taken: set[int] = set()
    port = listen_port(taken=taken)
    settings = DevStackSettings(home=home, pg_port=port, pg_replica_port=listen_port(taken=taken))
    server = EmbeddedPostgres(settings)
    server.down()  # one a killed test session left running, on another port
    url = server.up().url
    assert url
    try:
        yield RestartablePostgres(server, Stack(url, kafka_bootstrap))
    finally:
        server.down()
