"""Ports for the servers a chaos run restarts, chosen below the kernel's ephemeral range.

A port the kernel hands out for a listener (bind to port 0) comes from the ephemeral range,
the same range it takes the local ports of outgoing connections from. A server the run
stops and starts again (the provider, PostgreSQL, Kafka) leaves its port free meanwhile;
any client connection opened in between may be given that very port, and the restarted
server then fails with "address already in use" (seen: the provider, after its outage,
while the indexers' connections came and went). Below the range, no connection takes it.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

from kbtools.devstack.settings import DevStackSettings

# The dev stack's default ports (its replicas' first few too) and the shared helper
# stack's, never taken by a run: the dev stack's lie in the range a run draws from.
_DEV = DevStackSettings.model_fields
_DEV_REPLICAS = 8
RESERVED = frozenset(
    {
        _DEV["pg_port"].default,
        *range(_DEV["pg_replica_port"].default, _DEV["pg_replica_port"].default + _DEV_REPLICAS),
        _DEV["kafka_port"].default,
        _DEV["kafka_controller_port"].default,
        56432,
        60092,
    }
)
_LOWEST = 20000


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range of local ports for outgoing connections (Linux's default when it
    cannot be read)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[:2]
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def listen_port(rng: random.Random | None = None, *, taken: set[int] | None = None) -> int:
    """A free port below the ephemeral range (above it when the range starts too low), not
    one of the dev stacks' nor one in ``taken``."""
    low, high = ephemeral_range()
    choices = range(_LOWEST, low) if low - _LOWEST >= 1000 else range(high + 1, 65536)
    draw = rng or random.SystemRandom()
    avoid = RESERVED | (taken or set())
    for _ in range(200):
        port = draw.choice(choices)
        if port in avoid:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        if taken is not None:
            taken.add(port)
        return port
    raise RuntimeError(f"no free port in {choices.start}-{choices.stop - 1}")
