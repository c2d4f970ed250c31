"""A free TCP port for a server started in a subprocess, chosen outside the kernel's ephemeral range.

A port taken from `bind(0)` lies in the ephemeral range (`/proc/sys/net/ipv4/ip_local_port_range`,
32768-60999 by default). Between closing that probe socket and the server's own bind, any process
that opens an outgoing connection may be handed the same port. Ray does exactly that: it starts
its GCS, raylet and workers, which connect to each other, before Serve binds its HTTP port, and a
CI run failed with "Failed to bind to address '127.0.0.1:43671'". A port below the ephemeral
range and above Ray's worker ports (10002-19999) is never handed out that way.
"""
from __future__ import annotations

import random
import socket

RAY_MAX_WORKER_PORT = 19999


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port in [20000, ephemeral low) that binds on 127.0.0.1 now.

    Raises:
        RuntimeError: no such port binds after 200 tries.
    """
    low, high = RAY_MAX_WORKER_PORT + 1, _ephemeral_low()
    if high <= low + 100:  # an unusual range: fall back to any port the kernel gives
        low, high = 1024, 65535
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(low, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free TCP port in [{low}, {high}) on 127.0.0.1 after 200 tries")
