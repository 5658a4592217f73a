"""A replaced engine's port (:meth:`vime_core.engines.engine.VLLMServer.start_again`, :mod:`vime_core.cluster.net`):
the replacement takes the same port once the old process released it, a fresh one when something still holds it — never
"Address already in use". The real engine restarts are in ``tests/integration/test_fault_injection.py``."""

from __future__ import annotations

import socket

import pytest

from vime_core.cluster.net import find_free_port, port_is_free, wait_port_free
from vime_core.engines.engine import VLLMServer

pytestmark = pytest.mark.unit


def _listen(port: int = 0) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def test_a_port_someone_listens_on_is_not_free_and_is_once_released():
    s = _listen()
    port = s.getsockname()[1]
    assert not port_is_free("127.0.0.1", port)
    assert not wait_port_free("127.0.0.1", port, timeout_s=0.3)
    s.close()
    assert port_is_free("127.0.0.1", port) and wait_port_free("127.0.0.1", port, timeout_s=0.3)


@pytest.mark.parametrize("held", [False, True])
def test_start_again_keeps_a_released_port_and_moves_off_a_held_one(tiny_model_dir, held):
    port = find_free_port()
    server = VLLMServer(tiny_model_dir, port=port)
    server.port_release_s = 0.3
    calls: list[tuple[str, int]] = []
    server.stop = lambda *a: calls.append(("stop", server.port))
    server.start = lambda: calls.append(("start", server.port))
    holder = _listen(port) if held else None
    try:
        new = server.start_again()
    finally:
        if holder is not None:
            holder.close()
    assert calls == [("stop", port), ("start", new)]
    assert (new != port) is held and server.port == new
    assert server.url == f"http://127.0.0.1:{new}" and str(server._http.base_url) == f"http://127.0.0.1:{new}"
    assert f"--port {new} " in " ".join(server.command()) + " "
    server._http.close()
