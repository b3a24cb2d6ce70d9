"""Who a process is when it holds a lease: ``host:pid:random``.

The random part makes a restarted process a new owner even on the same host with the same
pid, so it can never match a fence its previous life held.
"""

from __future__ import annotations

import os
import socket
import uuid


def owner_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
