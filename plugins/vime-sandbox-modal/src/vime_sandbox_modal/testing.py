"""A local stand-in for Modal's services, for tests: the control-plane API (``modal.api.ModalClient``) and a task
command router (``modal.task_command_router.TaskCommandRouter``), both gRPC over grpclib on one 127.0.0.1 port.

Published on purpose (as pytest ships ``pytester``), so that code built on this plugin can be tested offline too;
install it with the ``testing`` extra: ``pip install 'vime-sandbox-modal[testing]'`` (vime's own test kit; grpclib
and ``modal_proto`` come with the ``modal`` SDK). The plugin itself never imports this module.

Not a mock of the SDK: the real ``modal`` client code (its grpclib channels, retries, resolver, sandbox and exec
implementations) talks gRPC to this server, which implements the SDK's generated service bases
(``modal_proto.api_grpc.ModalClientBase``, ``modal_proto.task_command_router_grpc.TaskCommandRouterBase``) with the
``modal_proto`` messages. Behind it every Modal sandbox is a vime ``local`` sandbox (new mount/pid/network
namespaces on a root host, its ``cpu``/``memory`` as limits), so commands really run, isolated.

Implemented (what :class:`vime_sandbox_modal.ModalSandbox` uses; every other method answers ``UNIMPLEMENTED``):
``ClientHello`` (token checked), ``AuthTokenGet``, ``EnvironmentGetOrCreate``, ``AppGetOrCreate``,
``ImageGetOrCreate`` (answers "already built"), ``SandboxCreateV2``/``SandboxCreate`` (``network_access``
BLOCKED/OPEN, ``resources``, ``timeout_secs``, tags, ephemeral env), ``SandboxGetCommandRouterAccess``/
``TaskGetCommandRouterAccess`` (plain http on 127.0.0.1, which the SDK allows for a localhost server), and (V2 and
V1 names) ``SandboxGetTaskId``, ``SandboxTerminate``, ``SandboxWait``, ``SandboxList`` (tag filter),
``SandboxTagsGet``; on the router ``TaskExecStart`` (argv, workdir, env from ``secret_sources``),
``TaskExecStdioRead`` (stdout/stderr from an offset), ``TaskExecStdinWrite`` (offset, EOF),
``TaskExecWait``/``TaskExecPoll`` (exit code or signal), with the router's JWT checked. A sandbox ends at its
``timeout_secs``, as Modal's do.

Not implemented: image builds (any image runs the host's userland; ``workdir`` is not created — commands start in
the sandbox's own directory), secrets objects, volumes, tunnels, snapshots, PTYs.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import secrets
import socket
import threading
import time
import uuid
from typing import Any

from grpclib.const import Status
from grpclib.exceptions import GRPCError
from modal_proto import api_grpc, api_pb2, task_command_router_grpc
from modal_proto import task_command_router_pb2 as sr_pb2

TOKEN_ID = "ak-fake0123456789"
TOKEN_SECRET = "as-fake0123456789"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _jwt(claims: dict[str, Any]) -> str:
    """An (unsigned) JWT carrying ``claims``: the SDK reads only its ``exp``."""

    def part(obj: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj).encode()).rstrip(b"=").decode()

    return f"{part({'alg': 'none', 'typ': 'JWT'})}.{part(claims)}.{secrets.token_hex(8)}"


def _fill_unimplemented(cls: type) -> type:
    """Give every abstract RPC of a grpclib service base an ``UNIMPLEMENTED`` answer (the real server's for an
    unknown method), so that the fake serves the whole service."""

    def make(name: str) -> Any:
        async def unimplemented(self: Any, stream: Any) -> None:
            self.fake.unimplemented.append(name)
            raise GRPCError(Status.UNIMPLEMENTED, f"{name} is not implemented by the fake Modal")

        return unimplemented

    for name in list(getattr(cls, "__abstractmethods__", ())):
        setattr(cls, name, make(name))
    cls.__abstractmethods__ = frozenset()
    return cls


class _Exec:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.out = bytearray()
        self.err = bytearray()
        self.closed = {1: False, 2: False}
        self.changed = asyncio.Condition()
        self.stdin_offset = 0
        self.pumps = [
            asyncio.ensure_future(self._pump(proc.stdout, self.out, 1)),
            asyncio.ensure_future(self._pump(proc.stderr, self.err, 2)),
        ]

    async def _pump(self, stream: asyncio.StreamReader, buf: bytearray, fd: int) -> None:
        while chunk := await stream.read(65536):
            async with self.changed:
                buf += chunk
                self.changed.notify_all()
        async with self.changed:
            self.closed[fd] = True
            self.changed.notify_all()


class _FakeSandbox:
    def __init__(
        self, sandbox_id: str, app_id: str, definition: Any, tags: dict[str, str], env: dict[str, str]
    ) -> None:
        from vime_core.sandbox import SandboxLimits
        from vime_core.sandbox.local import LocalSandbox

        self.id = sandbox_id
        self.app_id = app_id
        self.task_id = "ta-" + uuid.uuid4().hex[:20]
        self.tags = tags
        self.env = env
        self.token = secrets.token_hex(12)
        self.definition = definition
        self.created_at = time.time()
        res = definition.resources
        limits = SandboxLimits(
            cpus=res.milli_cpu / 1000 if res.milli_cpu else None,
            memory_bytes=(res.memory_mb_max or res.memory_mb) << 20 if res.memory_mb else None,
            wall_time_s=None,
        )
        blocked = definition.block_network or (
            definition.HasField("network_access")
            and definition.network_access.network_access_type == api_pb2.NetworkAccess.NetworkAccessType.BLOCKED
        )  # an ALLOWLIST cannot be emulated here: it gets the network
        self.local = LocalSandbox(limits=limits, network=not blocked)
        self.execs: dict[str, _Exec] = {}
        self.result: api_pb2.GenericResult | None = None
        self.timer: asyncio.TimerHandle | None = None

    async def start(self) -> None:
        await self.local.start()
        timeout = self.definition.timeout_secs or 300
        loop = asyncio.get_running_loop()
        self.timer = loop.call_later(
            timeout, lambda: asyncio.ensure_future(self.terminate(api_pb2.GenericResult.GENERIC_STATUS_TIMEOUT))
        )

    async def terminate(self, status: int = api_pb2.GenericResult.GENERIC_STATUS_TERMINATED) -> None:
        if self.result is None:
            self.result = api_pb2.GenericResult(status=status)
        if self.timer is not None:
            self.timer.cancel()
        for ex in self.execs.values():
            with contextlib.suppress(ProcessLookupError):
                ex.proc.kill()
        await self.local.close()


class FakeModal:
    """The fake service; a context manager that serves on 127.0.0.1 in a thread of its own.

    :ivar url: ``http://127.0.0.1:PORT`` (control plane and command router).
    :ivar sandboxes: sandboxes by id (the server's view, for tests).
    :ivar created: the ``SandboxCreateRequest`` messages received, for tests.
    :ivar unimplemented: names of methods called that the fake does not implement.
    """

    def __init__(self) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.sandboxes: dict[str, _FakeSandbox] = {}
        self.apps: dict[str, str] = {}
        self.created: list[api_pb2.SandboxCreateRequest] = []
        self.unimplemented: list[str] = []
        self.jwt = _jwt({"exp": time.time() + 86400, "sub": "task-command-router"})
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None

    def env(self) -> dict[str, str]:
        """SDK environment pointing at this server."""
        return {"MODAL_SERVER_URL": self.url, "MODAL_TOKEN_ID": TOKEN_ID, "MODAL_TOKEN_SECRET": TOKEN_SECRET}

    def __enter__(self) -> FakeModal:
        from grpclib.server import Server

        ready = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)

            async def main() -> None:
                self._stop = asyncio.Event()
                self._server = Server([_ControlPlane(self), _Router(self)])
                try:
                    await self._server.start("127.0.0.1", self.port)
                except BaseException as e:
                    errors.append(e)
                    ready.set()
                    return
                ready.set()
                await self._stop.wait()
                for sb in list(self.sandboxes.values()):
                    await sb.terminate()
                self._server.close()
                await self._server.wait_closed()

            self._loop.run_until_complete(main())

        self._thread = threading.Thread(target=run, name="fake-modal", daemon=True)
        self._thread.start()
        if not ready.wait(30) or errors:
            raise RuntimeError(f"fake modal server did not start: {errors}")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(30)

    def call(self, coro: Any, timeout: float = 60.0) -> Any:
        """Run a coroutine on the server's loop (for tests that act on the server side)."""
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def sandbox(self, sandbox_id: str) -> _FakeSandbox:
        sb = self.sandboxes.get(sandbox_id)
        if sb is None:
            raise GRPCError(Status.NOT_FOUND, f"Sandbox {sandbox_id} not found")
        return sb

    def by_task(self, task_id: str) -> _FakeSandbox:
        for sb in self.sandboxes.values():
            if sb.task_id == task_id:
                if sb.result is not None:
                    raise GRPCError(Status.NOT_FOUND, f"Task {task_id} has finished")
                return sb
        raise GRPCError(Status.NOT_FOUND, f"Task {task_id} not found")


@_fill_unimplemented
class _ControlPlane(api_grpc.ModalClientBase):
    def __init__(self, fake: FakeModal) -> None:
        self.fake = fake

    @staticmethod
    def _auth(stream: Any) -> None:
        md = stream.metadata or {}
        if md.get("x-modal-token-id") != TOKEN_ID or md.get("x-modal-token-secret") != TOKEN_SECRET:
            raise GRPCError(Status.UNAUTHENTICATED, "Invalid token id or secret")

    async def ClientHello(self, stream: Any) -> None:
        await stream.recv_message()
        self._auth(stream)
        await stream.send_message(api_pb2.ClientHelloResponse(image_builder_version="2025.06"))

    async def AuthTokenGet(self, stream: Any) -> None:
        await stream.recv_message()
        self._auth(stream)
        await stream.send_message(api_pb2.AuthTokenGetResponse(token=_jwt({"exp": time.time() + 3600})))

    async def EnvironmentGetOrCreate(self, stream: Any) -> None:
        req = await stream.recv_message()
        self._auth(stream)
        name = req.deployment_name or "main"
        await stream.send_message(
            api_pb2.EnvironmentGetOrCreateResponse(
                environment_id="en-" + name,
                metadata=api_pb2.EnvironmentMetadata(
                    name=name, settings=api_pb2.EnvironmentSettings(image_builder_version="2025.06")
                ),
            )
        )

    async def AppGetOrCreate(self, stream: Any) -> None:
        req = await stream.recv_message()
        self._auth(stream)
        app_id = self.fake.apps.setdefault(req.app_name, "ap-" + uuid.uuid4().hex[:20])
        await stream.send_message(api_pb2.AppGetOrCreateResponse(app_id=app_id))

    async def ImageGetOrCreate(self, stream: Any) -> None:
        await stream.recv_message()
        self._auth(stream)
        await stream.send_message(
            api_pb2.ImageGetOrCreateResponse(
                image_id="im-" + uuid.uuid4().hex[:20],
                result=api_pb2.GenericResult(status=api_pb2.GenericResult.GENERIC_STATUS_SUCCESS),
            )
        )

    async def _create(self, req: Any, v2: bool) -> _FakeSandbox:
        self.fake.created.append(req)
        # V1 ids are "sb-" + 22 characters; other lengths are V2 sandboxes to the SDK (V2 task ids end in "V")
        sid = ("sb-" + uuid.uuid4().hex[:22]) if not v2 else ("sb-" + uuid.uuid4().hex[:26])
        env: dict[str, str] = {}
        for src in getattr(req, "secret_sources", ()):
            if src.HasField("env"):
                env.update(src.env.contents)
        sb = _FakeSandbox(sid, req.app_id, req.definition, {t.tag_name: t.tag_value for t in req.tags}, env)
        if v2:
            sb.task_id += "V"
        try:
            await sb.start()
        except Exception as e:  # noqa: BLE001 - the API reports it
            raise GRPCError(Status.INTERNAL, f"could not start sandbox: {e}") from e
        self.fake.sandboxes[sid] = sb
        return sb

    async def SandboxCreate(self, stream: Any) -> None:
        req = await stream.recv_message()
        self._auth(stream)
        sb = await self._create(req, v2=False)
        await stream.send_message(api_pb2.SandboxCreateResponse(sandbox_id=sb.id))

    async def SandboxCreateV2(self, stream: Any) -> None:
        req = await stream.recv_message()
        self._auth(stream)
        sb = await self._create(req, v2=True)
        await stream.send_message(
            api_pb2.SandboxCreateV2Response(
                sandbox_id=sb.id,
                task_id=sb.task_id,
                sandbox_token=sb.token,
                command_router_access=api_pb2.CommandRouterAccess(url=self.fake.url, jwt=self.fake.jwt),
            )
        )

    async def SandboxGetCommandRouterAccess(self, stream: Any) -> None:
        await stream.recv_message()
        self._auth(stream)
        await stream.send_message(api_pb2.SandboxGetCommandRouterAccessResponse(jwt=self.fake.jwt, url=self.fake.url))

    async def SandboxGetTaskId(self, stream: Any) -> None:
        req = await stream.recv_message()
        self._auth(stream)
        sb = self.fake.sandbox(req.sandbox_id)
        resp = api_pb2.SandboxGetTaskIdResponse(task_id=sb.task_id)
        if sb.result is not None:
            resp.task_result.CopyFrom(sb.result)
        await stream.send_message(resp)

    async def TaskGetCommandRouterAccess(self, stream: Any) -> None:
        await stream.recv_message()
        self._auth(stream)
        await stream.send_message(api_pb2.TaskGetCommandRouterAccessResponse(jwt=self.fake.jwt, url=self.fake.url))

    async def SandboxTerminate(self, stream: Any) -> None:
        req = await stream.recv_message()
        self._auth(stream)
        sb = self.fake.sandbox(req.sandbox_id)
        existing = sb.result
        await sb.terminate()
        resp = api_pb2.SandboxTerminateResponse()
        if existing is not None:
            resp.existing_result.CopyFrom(existing)
        await stream.send_message(resp)

    async def SandboxWait(self, stream: Any) -> None:
        req = await stream.recv_message()
        self._auth(stream)
        sb = self.fake.sandbox(req.sandbox_id)
        t_end = time.monotonic() + max(0.0, req.timeout)
        while sb.result is None and time.monotonic() < t_end:
            await asyncio.sleep(0.1)
        resp = api_pb2.SandboxWaitResponse()
        if sb.result is not None:
            resp.result.CopyFrom(sb.result)
        await stream.send_message(resp)

    async def SandboxList(self, stream: Any) -> None:
        req = await stream.recv_message()
        self._auth(stream)
        want = {t.tag_name: t.tag_value for t in req.tags}
        rows = [
            api_pb2.SandboxInfo(
                id=sb.id,
                app_id=sb.app_id,
                created_at=sb.created_at,
                tags=[api_pb2.SandboxTag(tag_name=k, tag_value=v) for k, v in sb.tags.items()],
            )
            for sb in sorted(self.fake.sandboxes.values(), key=lambda s: -s.created_at)
            if (not req.app_id or sb.app_id == req.app_id)
            and (req.include_finished or sb.result is None)
            and all(sb.tags.get(k) == v for k, v in want.items())
            and (not req.before_timestamp or sb.created_at < req.before_timestamp)
        ]
        await stream.send_message(api_pb2.SandboxListResponse(sandboxes=rows))

    async def SandboxTagsGet(self, stream: Any) -> None:
        req = await stream.recv_message()
        self._auth(stream)
        sb = self.fake.sandbox(req.sandbox_id)
        await stream.send_message(
            api_pb2.SandboxTagsGetResponse(
                tags=[api_pb2.SandboxTag(tag_name=k, tag_value=v) for k, v in sb.tags.items()]
            )
        )

    # V2 sandboxes (the SDK's default) use the same messages under other names
    SandboxGetTaskIdV2 = SandboxGetTaskId
    SandboxTerminateV2 = SandboxTerminate
    SandboxWaitV2 = SandboxWait
    SandboxListV2 = SandboxList
    SandboxTagsGetV2 = SandboxTagsGet


@_fill_unimplemented
class _Router(task_command_router_grpc.TaskCommandRouterBase):
    def __init__(self, fake: FakeModal) -> None:
        self.fake = fake

    def _auth(self, stream: Any) -> None:
        if (stream.metadata or {}).get("authorization") != f"Bearer {self.fake.jwt}":
            raise GRPCError(Status.UNAUTHENTICATED, "invalid router token")

    def _exec(self, task_id: str, exec_id: str) -> _Exec:
        ex = self.fake.by_task(task_id).execs.get(exec_id)
        if ex is None:
            raise GRPCError(Status.NOT_FOUND, f"exec {exec_id} not found")
        return ex

    async def TaskExecStart(self, stream: Any) -> None:
        from vime_core.sandbox.local import DEFAULT_PATH, ENV_ID

        req = await stream.recv_message()
        self._auth(stream)
        sb = self.fake.by_task(req.task_id)
        if req.exec_id in sb.execs:  # idempotent by exec id, as the router is
            await stream.send_message(sr_pb2.TaskExecStartResponse())
            return
        env = {"PATH": DEFAULT_PATH, "HOME": "/root", "LANG": "C.UTF-8", "TMPDIR": "/tmp", **sb.env}
        for src in req.secret_sources:
            if src.HasField("env"):
                env.update(src.env.contents)
        for entry in req.env:
            env[entry.name] = entry.value
        env[ENV_ID] = sb.local.sandbox_id
        cwd = req.workdir if req.HasField("workdir") and req.workdir else sb.local.workspace
        try:
            proc = await asyncio.create_subprocess_exec(
                *sb.local._command(list(req.command_args), cwd, None),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=env,
                start_new_session=True,
                preexec_fn=sb.local._child_setup(sb.local._rlimits()),
            )
        except OSError as e:
            raise GRPCError(Status.FAILED_PRECONDITION, f"could not start {list(req.command_args)}: {e}") from e
        sb.execs[req.exec_id] = _Exec(proc)
        if req.HasField("timeout_secs") and req.timeout_secs:
            asyncio.get_running_loop().call_later(req.timeout_secs, lambda: proc.returncode is None and proc.kill())
        await stream.send_message(sr_pb2.TaskExecStartResponse())

    async def TaskExecStdioRead(self, stream: Any) -> None:
        req = await stream.recv_message()
        self._auth(stream)
        ex = self._exec(req.task_id, req.exec_id)
        fd = 2 if req.file_descriptor == sr_pb2.TASK_EXEC_STDIO_FILE_DESCRIPTOR_STDERR else 1
        buf = ex.err if fd == 2 else ex.out
        offset = int(req.offset)
        while True:
            async with ex.changed:
                while len(buf) <= offset and not ex.closed[fd]:
                    await ex.changed.wait()
                data = bytes(buf[offset : offset + 65536])
                done = ex.closed[fd] and offset + len(data) >= len(buf)
            if data:
                await stream.send_message(sr_pb2.TaskExecStdioReadResponse(data=data))
                offset += len(data)
            if done:
                return

    async def TaskExecStdinWrite(self, stream: Any) -> None:
        req = await stream.recv_message()
        self._auth(stream)
        ex = self._exec(req.task_id, req.exec_id)
        stdin = ex.proc.stdin
        assert stdin is not None
        start = int(req.offset)
        if start + len(req.data) > ex.stdin_offset:  # writes are idempotent by offset
            new = req.data[max(0, ex.stdin_offset - start) :]
            if new and not stdin.is_closing():
                stdin.write(new)
                with contextlib.suppress(ConnectionError):
                    await stdin.drain()
            ex.stdin_offset = start + len(req.data)
        if req.eof and not stdin.is_closing():
            stdin.close()
        await stream.send_message(sr_pb2.TaskExecStdinWriteResponse())

    def _status(self, ex: _Exec, resp_cls: Any) -> Any:
        code = ex.proc.returncode
        if code is None:
            return resp_cls()
        return resp_cls(signal=-code) if code < 0 else resp_cls(code=code)

    async def TaskExecWait(self, stream: Any) -> None:
        req = await stream.recv_message()
        self._auth(stream)
        ex = self._exec(req.task_id, req.exec_id)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(ex.proc.wait(), 55)
        if ex.proc.returncode is None:
            raise GRPCError(Status.DEADLINE_EXCEEDED, "exec still running")
        await stream.send_message(self._status(ex, sr_pb2.TaskExecWaitResponse))

    async def TaskExecPoll(self, stream: Any) -> None:
        req = await stream.recv_message()
        self._auth(stream)
        ex = self._exec(req.task_id, req.exec_id)
        await stream.send_message(self._status(ex, sr_pb2.TaskExecPollResponse))
