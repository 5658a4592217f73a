"""Network addresses of this process: a free TCP port, whether a port is free, this node's address, ``HOST:PORT``
parsing (a leaf module: imports nothing of vime)."""

from __future__ import annotations

import socket


def split_host_port(addr: str) -> tuple[str, int]:
    """``HOST:PORT`` as ``(host, port)``.

    :raises ValueError: no host, or a port that is not a number in 1 … 65535 (the message quotes ``addr``).
    """
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT, got {addr!r}")
    return host, int(port)


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (bound with port 0, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_is_free(host: str, port: int) -> bool:
    """Whether a server could bind TCP ``port`` on ``host`` now (SO_REUSEADDR, as servers set it: a port held only by
    sockets in TIME_WAIT counts as free, one a live process listens on does not)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def wait_port_free(host: str, port: int, timeout_s: float, poll_s: float = 0.2) -> bool:
    """Wait up to ``timeout_s`` seconds until :func:`port_is_free`; whether it is."""
    import time

    deadline = time.monotonic() + timeout_s
    while not port_is_free(host, port):
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True


def node_ip() -> str:
    """This process's Ray node address (127.0.0.1 outside Ray and on the default loopback cluster)."""
    import ray  # Ray is only imported when asked: this module is imported by processes that never start Ray

    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
