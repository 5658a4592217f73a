"""Host-port forwarding for sandboxes without network: a host service (e.g. the agent gateway on 127.0.0.1) made
reachable from inside a sandbox through a **unix socket**, never through a network interface.

:class:`UnixToTcpForwarder` (host side, threads of its own) connects each connection on a unix socket the sandbox
can see to ``host:port``; :data:`SANDBOX_FORWARDER_PY` (sandbox side, stdlib only, started by
:func:`start_sandbox_forwarder`) listens on the sandbox's ``127.0.0.1:<port>`` and connects to that socket. Used by
the ``local`` and ``docker`` backends' ``expose_host_port``: docs/agents.md, "Reaching the gateway without a network".
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from pathlib import Path

from vime_core.sandbox.base import SandboxInfraError

logger = logging.getLogger("vime.sandbox")

#: In-sandbox half: ``python3 -c SANDBOX_FORWARDER_PY <listen_port> <unix socket path> <ready file>``.
SANDBOX_FORWARDER_PY = r"""
import os, socket, sys, threading
port, path, ready = int(sys.argv[1]), sys.argv[2], sys.argv[3]
srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", port))
srv.listen(128)
open(ready, "w").close()
def pump(a, b):
    try:
        while True:
            d = a.recv(65536)
            if not d:
                break
            b.sendall(d)
    except OSError:
        pass
    finally:
        try:
            b.shutdown(socket.SHUT_WR)
        except OSError:
            pass
def handle(c):
    u = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        u.connect(path)
    except OSError:
        c.close()
        return
    t = threading.Thread(target=pump, args=(u, c), daemon=True)
    t.start()
    pump(c, u)
    t.join()
    c.close()
    u.close()
while True:
    c, _ = srv.accept()
    threading.Thread(target=handle, args=(c,), daemon=True).start()
"""


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while True:
            data = src.recv(65536)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)


class UnixToTcpForwarder:
    """Accepts on the unix socket ``path`` and forwards each connection to TCP ``host:port`` (host side).

    :param path: socket path to create (its directory must exist; an existing file is replaced). Made
        world-connectable (mode 0o777) so that any sandbox user may connect.
    :param host: target address on the host (e.g. ``127.0.0.1``).
    :param port: target TCP port.
    :raises OSError: the socket cannot be created (path too long: at most 107 bytes).
    """

    def __init__(self, path: str | os.PathLike[str], host: str, port: int) -> None:
        self.path, self.host, self.port = str(path), host, int(port)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self._srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._srv.bind(self.path)
        os.chmod(self.path, 0o777)
        self._srv.listen(128)
        self._closed = False
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, name=f"vime-fwd-{port}", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._srv.accept()
            except OSError:
                break
            threading.Thread(target=self._handle, args=(client,), daemon=True).start()

    def _handle(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection((self.host, self.port), timeout=10)
            upstream.settimeout(None)
        except OSError as e:
            logger.warning("sandbox port forward: cannot reach %s:%s: %s", self.host, self.port, e)
            client.close()
            return
        with self._lock:
            if self._closed:
                client.close()
                upstream.close()
                return
            self._conns |= {client, upstream}
        t = threading.Thread(target=_pump, args=(upstream, client), daemon=True)
        t.start()
        _pump(client, upstream)
        t.join()
        with self._lock:
            self._conns -= {client, upstream}
        client.close()
        upstream.close()

    def close(self) -> None:
        """Stop accepting, cut open connections, remove the socket file (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns = list(self._conns)
        with contextlib.suppress(OSError):
            self._srv.shutdown(socket.SHUT_RDWR)
        self._srv.close()
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self._thread.join(timeout=5)


async def start_sandbox_forwarder(sandbox, port: int, socket_path: str, *, python: str = "python3") -> None:
    """Start :data:`SANDBOX_FORWARDER_PY` detached in ``sandbox`` (listening on its ``127.0.0.1:port``, connecting
    to ``socket_path`` as seen inside) and wait until it listens.

    :raises SandboxInfraError: the forwarder did not come up within 30 s (its stderr included).
    """
    import asyncio
    import shlex
    import time

    ready = f"{sandbox.control_dir}/fwd-{int(port)}.ready"
    cmd = (
        f"exec {shlex.quote(python)} -I -c {shlex.quote(SANDBOX_FORWARDER_PY)} {int(port)} "
        f"{shlex.quote(socket_path)} {shlex.quote(ready)}"
    )
    proc = await sandbox.start_detached(cmd, cwd="/")
    t_end = time.monotonic() + 30
    while time.monotonic() < t_end:
        r = await sandbox.exec(["test", "-e", ready], timeout=30)
        if r.exit_code == 0:
            return
        done = await sandbox.poll(proc)
        if done is not None:
            raise SandboxInfraError(
                f"{sandbox.NAME} sandbox {sandbox.sandbox_id}: port forwarder for {port} exited "
                f"({done.exit_code}): {done.stderr[-500:]}"
            )
        await asyncio.sleep(0.05)
    raise SandboxInfraError(f"{sandbox.NAME} sandbox {sandbox.sandbox_id}: port forwarder for {port} did not start")


def socket_name(port: int) -> str:
    """File name of the unix socket for host port ``port``."""
    return f"port-{int(port)}.sock"


def ensure_dir(path: Path) -> Path:
    """``path`` created (mode 0o755) if missing."""
    path.mkdir(parents=True, exist_ok=True)
    return path
