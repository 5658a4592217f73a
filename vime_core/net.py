"""Network addresses of this process: a free TCP port, this node's address (a leaf module: imports nothing of vime)."""

from __future__ import annotations

import socket


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (bound with port 0, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def node_ip() -> str:
    """This process's Ray node address (127.0.0.1 outside Ray and on the default loopback cluster)."""
    import ray  # Ray is only imported when asked: this module is imported by processes that never start Ray

    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
