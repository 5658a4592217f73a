"""``LocalVMSandbox.expose_host_port`` on the session VM: a host HTTP server on 127.0.0.1 answers from inside the
guest through SSH remote forwarding, while another host port and the outside stay unreachable."""

from __future__ import annotations

import http.server
import threading

import pytest

from vime_core.testing.contracts import SandboxBackendContract

pytestmark = [pytest.mark.contract, pytest.mark.slow]


def _serve(body: bytes) -> http.server.ThreadingHTTPServer:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            payload = body + self.path.encode()
            self.send_response(200)
            self.send_header("content-length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *a) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def test_expose_host_port_over_ssh(session_vm):
    sb = session_vm.sandbox
    exposed, hidden = _serve(b"exposed:"), _serve(b"hidden:")
    get = SandboxBackendContract._HTTP_GET
    try:
        addr = session_vm.run(sb.expose_host_port(exposed.server_address[1]))
        assert addr == f"127.0.0.1:{exposed.server_address[1]}"
        assert session_vm.run(sb.expose_host_port(exposed.server_address[1])) == addr
        r = session_vm.run(sb.exec(["python3", "-c", get, f"http://{addr}/vm"], timeout=60))
        assert r.stdout == "ok exposed:/vm\n", r.stdout + r.stderr
        other = f"http://127.0.0.1:{hidden.server_address[1]}/x"
        r = session_vm.run(sb.exec(["python3", "-c", get, other], timeout=60))
        assert r.stdout.startswith("failed"), r.stdout + r.stderr
    finally:
        exposed.shutdown()
        hidden.shutdown()
