"""A dev-stack replica follows the primary of this start, not the one its copy was taken
from: a copy made while the primary listened on another port still streams (no server is
started here; the options are what ``pg_ctl`` is given)."""

from __future__ import annotations

import socket
from pathlib import Path

from kbtools.devstack.process import port_bindable
from kbtools.devstack.replicas import EmbeddedReplica
from kbtools.devstack.settings import DevStackSettings


def test_the_replica_is_started_pointing_at_the_primarys_current_port(tmp_path: Path) -> None:
    settings = DevStackSettings(home=tmp_path, pg_port=47001, pg_replica_port=47011)
    options = EmbeddedReplica(settings, 2)._server_options()
    conninfo = [option for option in options if option.startswith("primary_conninfo=")]
    assert conninfo == ["primary_conninfo='host=127.0.0.1 port=47001 user=postgres'"]
    assert "port=47012" in options


def test_a_port_held_by_a_listener_or_a_client_connection_is_not_bindable() -> None:
    """kbtools/devstack/process.py: the broker's ports are checked before it starts, to
    name the setting to change (the JVM's log says only that the address is in use); a
    client connection's ephemeral end holds a port as a listener does."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert not port_bindable("127.0.0.1", port)
        with socket.socket() as client:
            client.bind(("127.0.0.1", 0))
            client_port = client.getsockname()[1]
            client.connect(("127.0.0.1", port))
            assert not port_bindable("127.0.0.1", client_port)
    assert port_bindable("127.0.0.1", port)
