"""A TCP port for a job's rendezvous (``MASTER_PORT``) that two jobs started side by side do not
share.

Binding port 0 and closing the socket hands back a port from the kernel's ephemeral range: between
that and the job binding it, any outgoing connection or gloo listener on the machine may take it
(CI saw ``EADDRINUSE`` on such a port while other test workers ran jobs). A port below the
ephemeral range is never handed out by the kernel, so only another caller of this helper could pick
the same one, and it picks at random among several thousand.
"""

from __future__ import annotations

import random
import socket

_FLOOR = 15000


def _ephemeral_floor() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def rendezvous_port(host: str = "127.0.0.1", tries: int = 200) -> int:
    """A port below the ephemeral range that ``host`` can bind now."""
    top = _ephemeral_floor() - 1
    low = _FLOOR if top - _FLOOR >= 1000 else 1024
    for _ in range(tries):
        port = random.randint(low, top)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no bindable port in {low}-{top} on {host} after {tries} tries")
