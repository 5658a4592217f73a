"""A local stand-in for E2B's services, for tests: the REST API and envd on one 127.0.0.1 port.

Published on purpose (as pytest ships ``pytester``), so that code built on this plugin can be tested offline too;
it needs the ``testing`` extra: ``pip install 'vime-sandbox-e2b[testing]'`` (uvicorn, and vime's own test kit).
The plugin itself never imports this module.

Not a mock of the SDK: the real ``e2b`` client code (its REST client, its Connect-RPC process client, its files
client over the same pyqwest transports) talks HTTP to this server, which answers in the wire shapes of E2B's
OpenAPI spec and envd's ``process.proto`` (served by the SDK's own generated ``ProcessASGIApplication`` on the
``connectrpc`` server). Behind it, every E2B sandbox is a vime ``local`` sandbox (new mount/pid/network
namespaces on a root host), so commands really run, isolated, in a fresh directory.

Implemented (what :class:`vime_sandbox_e2b.E2BSandbox` uses):

* REST (``X-API-KEY`` checked): ``POST /v2/sandboxes`` (also ``/sandboxes``; ``templateID``, ``timeout``,
  ``metadata``, ``envVars``, ``allow_internet_access``; 201 with ``sandboxID``, ``envdVersion``,
  ``envdAccessToken``), ``DELETE /sandboxes/{id}`` (204/404), ``GET /v2/sandboxes?metadata=``
  (``ListedSandbox`` list), ``POST /sandboxes/{id}/timeout``. A sandbox is killed at its ``timeout``, as E2B does.
* envd (routed by the ``E2b-Sandbox-Id`` header, ``X-Access-Token`` checked): ``GET /health``, ``GET /files``
  (bytes; 404 missing, 400 directory), ``POST /files`` (octet-stream; parents created), and the Connect RPCs
  ``process.Process/Start`` (start/data/end events), ``SendInput``, ``CloseStdin``, ``SendSignal``.

Not implemented: templates (any name runs the host's userland), pause/resume, snapshots, PTY, filesystem RPCs,
per-template CPU/memory sizes, users (everything runs as the server's user; envd's default is ``user``).

Usage::

    with FakeE2B() as fake:           # sets nothing globally; pass fake.env() to the SDK's environment
        os.environ.update(fake.env())
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import signal
import socket
import threading
import time
import urllib.parse
import uuid
from datetime import datetime, timezone
from typing import Any

from e2b.envd.process.process_connect import Process

ENVD_VERSION = "0.6.4"  # newest envd version this SDK knows features of (octet-stream upload, default user)
API_KEY = "e2b_fake_0123456789abcdef"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _FakeSandbox:
    def __init__(
        self,
        sandbox_id: str,
        template: str,
        metadata: dict[str, str],
        envs: dict[str, str],
        network: bool,
        timeout_s: int,
    ) -> None:
        from vime_core.sandbox import SandboxLimits
        from vime_core.sandbox.local import LocalSandbox

        self.id = sandbox_id
        self.template = template
        self.metadata = metadata
        self.envs = envs
        self.token = secrets.token_hex(16)
        self.started_at = datetime.now(timezone.utc)
        self.end_at = self.started_at
        self.local = LocalSandbox(limits=SandboxLimits(wall_time_s=None), network=network)
        self.procs: dict[int, asyncio.subprocess.Process] = {}
        self.timer: asyncio.TimerHandle | None = None
        self.set_timeout(timeout_s)

    def set_timeout(self, timeout_s: int) -> None:
        self.end_at = datetime.fromtimestamp(time.time() + timeout_s, timezone.utc)
        if self.timer is not None:
            self.timer.cancel()
        loop = asyncio.get_running_loop()
        self.timer = loop.call_later(timeout_s, lambda: asyncio.ensure_future(self.kill()))

    async def kill(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        await self.local.close()

    def listed(self) -> dict[str, Any]:
        return {
            "templateID": self.template,
            "sandboxID": self.id,
            "clientID": "fake",
            "alias": self.template,
            "startedAt": self.started_at.isoformat(),
            "endAt": self.end_at.isoformat(),
            "cpuCount": 2,
            "memoryMB": 512,
            "diskSizeMB": 1024,
            "state": "running",
            "envdVersion": ENVD_VERSION,
            "metadata": self.metadata,
        }

    def argv(self, argv: list[str], cwd: str | None) -> list[str]:
        return self.local._command(argv, cwd or self.local.workspace, None)

    def env(self, extra: dict[str, str]) -> dict[str, str]:
        from vime_core.sandbox.local import DEFAULT_PATH, ENV_ID

        return {
            "PATH": DEFAULT_PATH,
            "HOME": self.local.workspace,
            "LANG": "C.UTF-8",
            "TMPDIR": "/tmp",
            "USER": "user",
            **self.envs,
            **extra,
            ENV_ID: self.local.sandbox_id,
        }

    async def spawn(self, argv: list[str], cwd: str | None, env: dict[str, str], stdin: bool):
        proc = await asyncio.create_subprocess_exec(
            *self.argv(argv, cwd),
            stdin=asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=self.env(env),
            start_new_session=True,
            preexec_fn=self.local._child_setup(self.local._rlimits()),
        )
        self.procs[proc.pid] = proc
        return proc

    async def run_bytes(self, argv: list[str], stdin: bytes | None = None) -> tuple[int, bytes, bytes]:
        proc = await self.spawn(argv, None, {}, stdin is not None)
        out, err = await proc.communicate(stdin)
        self.procs.pop(proc.pid, None)
        return proc.returncode or 0, out, err


class FakeE2B:
    """The fake service; a context manager that serves on 127.0.0.1 in a thread of its own.

    :ivar url: ``http://127.0.0.1:PORT`` (both the API and envd).
    :ivar sandboxes: live sandboxes by id (the server's view, for tests' ``sandbox_exists``).
    """

    def __init__(self) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.sandboxes: dict[str, _FakeSandbox] = {}
        self.requests: list[tuple[str, str]] = []  # (method, path) of every request, for tests
        self.created: list[dict[str, Any]] = []  # JSON bodies of the sandbox-creation requests, for tests
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._tasks: list[asyncio.Future] = []

    def env(self) -> dict[str, str]:
        """SDK environment pointing at this server (HTTP/1.1: the fake speaks no h2c)."""
        return {
            "E2B_API_KEY": API_KEY,
            "E2B_API_URL": self.url,
            "E2B_SANDBOX_URL": self.url,
            "E2B_HTTP_VERSION": "1.1",
        }

    # -- lifecycle -------------------------------------------------------------------------------------------
    def __enter__(self) -> FakeE2B:
        import uvicorn

        config = uvicorn.Config(
            self._asgi,
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            lifespan="off",
            timeout_graceful_shutdown=1,
            interface="asgi3",
        )
        self._server = uvicorn.Server(config)
        ready = threading.Event()

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)

            async def main() -> None:
                task = asyncio.ensure_future(self._server.serve())
                while not self._server.started and not task.done():
                    await asyncio.sleep(0.02)
                ready.set()
                await task
                for sb in list(self.sandboxes.values()):
                    await sb.kill()
                for t in self._tasks:
                    t.cancel()

            self._loop.run_until_complete(main())

        self._thread = threading.Thread(target=run, name="fake-e2b", daemon=True)
        self._thread.start()
        if not ready.wait(30):
            raise RuntimeError("fake e2b server did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(30)

    def call(self, coro: Any, timeout: float = 60.0) -> Any:
        """Run a coroutine on the server's loop (for tests that act on the server side)."""
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    # -- ASGI ------------------------------------------------------------------------------------------------
    async def _asgi(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        self.requests.append((scope["method"], path))
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        if path.startswith("/process.Process/"):
            sb = self._envd_sandbox(headers)
            if isinstance(sb, tuple):
                return await _respond(send, *sb)
            return await self._process_app(sb)(scope, receive, send)
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        query = urllib.parse.parse_qs(scope.get("query_string", b"").decode())
        q = {k: v[0] for k, v in query.items()}
        if path in ("/files", "/health"):
            sb = self._envd_sandbox(headers)
            if isinstance(sb, tuple):
                return await _respond(send, *sb)
            if path == "/health":
                return await _respond(send, 204, b"")
            return await _respond(send, *(await self._files(sb, scope["method"], q, body)))
        if headers.get("x-api-key") != API_KEY:
            return await _respond(send, 401, {"code": 401, "message": "Invalid API key"})
        return await _respond(send, *(await self._rest(scope["method"], path, q, body)))

    def _envd_sandbox(self, headers: dict[str, str]) -> _FakeSandbox | tuple[int, Any]:
        sb = self.sandboxes.get(headers.get("e2b-sandbox-id", ""))
        if sb is None:
            return 502, {"code": 502, "message": "The sandbox was not found"}
        if headers.get("x-access-token") != sb.token:
            return 401, {"code": 401, "message": "invalid access token"}
        return sb

    # -- REST API --------------------------------------------------------------------------------------------
    async def _rest(self, method: str, path: str, q: dict[str, str], body: bytes) -> tuple[int, Any]:
        parts = [p for p in path.split("/") if p]
        if method == "POST" and parts in (["sandboxes"], ["v2", "sandboxes"]):
            req = json.loads(body)
            self.created.append(req)
            sid = "i" + uuid.uuid4().hex[:19]
            sb = _FakeSandbox(
                sid,
                req["templateID"],
                req.get("metadata") or {},
                req.get("envVars") or {},
                bool(req.get("allow_internet_access", True)),
                int(req.get("timeout", 15)),
            )
            try:
                await sb.local.start()
            except Exception as e:  # noqa: BLE001 - the API reports it
                return 500, {"code": 500, "message": f"failed to start sandbox: {e}"}
            self.sandboxes[sid] = sb
            self._tasks.append(asyncio.ensure_future(self._reap_when_closed(sb)))
            return 201, {
                "templateID": sb.template,
                "sandboxID": sid,
                "clientID": "fake",
                "alias": sb.template,
                "envdVersion": ENVD_VERSION,
                "envdAccessToken": sb.token,
                "domain": None,
            }
        if method == "DELETE" and len(parts) == 2 and parts[0] == "sandboxes":
            sb = self.sandboxes.pop(parts[1], None)
            if sb is None:
                return 404, {"code": 404, "message": f"sandbox {parts[1]} not found"}
            await sb.kill()
            return 204, b""
        if method == "POST" and len(parts) == 3 and parts[0] == "sandboxes" and parts[2] == "timeout":
            sb = self.sandboxes.get(parts[1])
            if sb is None:
                return 404, {"code": 404, "message": f"sandbox {parts[1]} not found"}
            sb.set_timeout(int(json.loads(body)["timeout"]))
            return 204, b""
        if method == "GET" and parts == ["v2", "sandboxes"]:
            want = dict(urllib.parse.parse_qsl(q.get("metadata", "")))
            rows = [
                sb.listed() for sb in self.sandboxes.values() if all(sb.metadata.get(k) == v for k, v in want.items())
            ]
            return 200, rows
        return 404, {"code": 404, "message": f"{method} {path}: not implemented by the fake"}

    async def _reap_when_closed(self, sb: _FakeSandbox) -> None:
        while not sb.local.closed:
            await asyncio.sleep(0.2)
        self.sandboxes.pop(sb.id, None)

    # -- envd files ------------------------------------------------------------------------------------------
    async def _files(self, sb: _FakeSandbox, method: str, q: dict[str, str], body: bytes) -> tuple[int, Any]:
        path = q.get("path", "")
        if not path.startswith("/"):
            path = f"{sb.local.workspace}/{path}"
        if method == "GET":
            rc, out, err = await sb.run_bytes(
                ["/bin/sh", "-c", 'if [ -d "$1" ]; then exit 21; fi; cat -- "$1"', "sh", path]
            )
            if rc == 0:
                return 200, out
            if rc == 21:
                return 400, {"code": 400, "message": f"path '{path}' is a directory"}
            return _file_error(err, path)
        if method == "POST":
            rc, _, err = await sb.run_bytes(
                ["/bin/sh", "-c", 'mkdir -p -- "$(dirname -- "$1")" && cat > "$1"', "sh", path], body
            )
            if rc != 0:
                return _file_error(err, path)
            return 200, [{"name": path.rsplit("/", 1)[-1], "type": "file", "path": path}]
        return 405, {"code": 405, "message": "method not allowed"}

    # -- envd process service --------------------------------------------------------------------------------
    def _process_app(self, sb: _FakeSandbox) -> Any:
        from e2b.envd.process.process_connect import ProcessASGIApplication

        return ProcessASGIApplication(_ProcessService(sb))


def _file_error(err: bytes, path: str) -> tuple[int, Any]:
    text = err.decode("utf-8", "replace").strip()
    low = text.lower()
    if "no such file" in low:
        return 404, {"code": 404, "message": f"path '{path}' does not exist"}
    if "permission denied" in low or "read-only" in low:
        return 403, {"code": 403, "message": f"error opening file '{path}': {text}"}
    return 500, {"code": 500, "message": text}


async def _respond(send: Any, status: int, body: Any) -> None:
    if isinstance(body, (bytes, bytearray)):
        data, ctype = bytes(body), b"application/octet-stream"
    else:
        data, ctype = json.dumps(body).encode(), b"application/json"
    headers = [(b"content-length", str(len(data)).encode())]
    if status != 204:
        headers.append((b"content-type", ctype))
    else:
        data = b""
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


class _ProcessService(Process):
    """envd's ``process.Process`` service over one fake sandbox (``StartRequest`` → start/data/end events); the
    methods not overridden answer ``UNIMPLEMENTED`` (the generated base class)."""

    def __init__(self, sb: _FakeSandbox) -> None:
        self.sb = sb

    def _proc(self, selector: Any) -> asyncio.subprocess.Process:
        from connectrpc.code import Code
        from connectrpc.errors import ConnectError

        proc = self.sb.procs.get(int(selector.selector.value)) if selector and selector.selector else None
        if proc is None:
            raise ConnectError(Code.NOT_FOUND, "process not found")
        return proc

    async def start(self, request: Any, ctx: Any):  # noqa: ANN201 - an async generator of StartResponse
        from e2b.envd.process import process_pb
        from protobuf import Oneof

        cfg = request.process
        proc = await self.sb.spawn([cfg.cmd, *cfg.args], cfg.cwd or None, dict(cfg.envs), bool(request.stdin))
        Ev = process_pb.ProcessEvent

        def event(field: str, value: Any) -> Any:
            return process_pb.StartResponse(event=Ev(event=Oneof(field, value)))

        yield event("start", Ev.StartEvent(pid=proc.pid))
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(stream: asyncio.StreamReader, name: str) -> None:
            while chunk := await stream.read(32768):
                await queue.put((name, chunk))
            await queue.put((name, None))

        pumps = [
            asyncio.ensure_future(pump(proc.stdout, "stdout")),
            asyncio.ensure_future(pump(proc.stderr, "stderr")),
        ]
        try:
            open_streams = 2
            while open_streams:
                name, chunk = await queue.get()
                if chunk is None:
                    open_streams -= 1
                    continue
                yield event("data", Ev.DataEvent(output=Oneof(name, chunk)))
            code = await proc.wait()
        finally:
            for p in pumps:
                p.cancel()
        self.sb.procs.pop(proc.pid, None)
        if code < 0:  # Go's ProcessState: exit code -1 when killed by a signal
            end = Ev.EndEvent(exit_code=-1, exited=False, status=f"signal: {signal.Signals(-code).name[3:].lower()}")
        else:
            end = Ev.EndEvent(exit_code=code, exited=True, status=f"exit status {code}")
        yield event("end", end)

    async def send_input(self, request: Any, ctx: Any) -> Any:
        from e2b.envd.process import process_pb

        proc = self._proc(request.process)
        if proc.stdin is not None and request.input and request.input.input:
            proc.stdin.write(request.input.input.value)
            with contextlib.suppress(ConnectionError):
                await proc.stdin.drain()
        return process_pb.SendInputResponse()

    async def close_stdin(self, request: Any, ctx: Any) -> Any:
        from e2b.envd.process import process_pb

        proc = self._proc(request.process)
        if proc.stdin is not None:
            proc.stdin.close()
        return process_pb.CloseStdinResponse()

    async def send_signal(self, request: Any, ctx: Any) -> Any:
        from e2b.envd.process import process_pb

        proc = self._proc(request.process)
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(int(request.signal.value) if hasattr(request.signal, "value") else int(request.signal))
        return process_pb.SendSignalResponse()
