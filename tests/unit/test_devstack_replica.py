"""A dev-stack replica follows the primary of this start, not the one its copy was taken
from: a copy made while the primary listened on another port still streams (no server is
started here; the options are what ``pg_ctl`` is given)."""

from __future__ import annotations

from pathlib import Path

from kbtools.devstack.replicas import EmbeddedReplica
from kbtools.devstack.settings import DevStackSettings


def test_the_replica_is_started_pointing_at_the_primarys_current_port(tmp_path: Path) -> None:
    settings = DevStackSettings(home=tmp_path, pg_port=47001, pg_replica_port=47011)
    options = EmbeddedReplica(settings, 2)._server_options()
    conninfo = [option for option in options if option.startswith("primary_conninfo=")]
    assert conninfo == ["primary_conninfo='host=127.0.0.1 port=47001 user=postgres'"]
    assert "port=47012" in options
