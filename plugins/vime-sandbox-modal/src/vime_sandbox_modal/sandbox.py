"""``ModalSandbox``: one Modal sandbox per vime sandbox, through the official ``modal`` SDK (``modal.Sandbox``).

Mapping of the contract onto Modal:

* create: ``App.lookup(app, create_if_missing=True)``, ``Image.from_registry(image)``, then
  ``Sandbox.create("sleep", "infinity", timeout=wall time + grace, workdir=/workspace, cpu, memory,
  block_network=not network, tags={vime labels})`` — **network off by default** (``block_network=True``). The
  workspace is the sandbox's working directory as the first command reports it.
* exec: ``Sandbox.exec(*argv, text=False)`` of the command inside vime's
  :data:`~vime_core.sandbox.base.EXEC_WRAPPER` (coreutils ``timeout -s KILL`` in the sandbox kills the whole process
  group at the timeout), with Modal's own exec ``timeout`` a little later as a backstop; stdout and stderr are read
  concurrently as byte chunks, the first ``max_output_bytes`` of each kept and the rest dropped as it arrives;
  stdin through the process's writer. Output is bytes, so files and directories use vime's exec-based defaults
  (``cat``/``tar`` through stdin and stdout) byte-exactly.
* limits: ``cpus`` → ``cpu``, ``memory_bytes`` → ``memory`` (MiB) — Modal's requests; no per-sandbox pids or disk
  limits, so the ``resource_limits`` capability is not declared.
* teardown: ``terminate``; Modal also ends the sandbox at its ``timeout`` (wall time + :data:`WALL_TIME_GRACE_S`).
* reaper: ``Sandbox.list(app_id, tags={"vime.backend": "modal"})``; those whose ``vime.owner`` tag names a
  process that is gone are terminated.

Credentials: ``MODAL_TOKEN_ID``/``MODAL_TOKEN_SECRET`` (or ``token_id=``/``token_secret=``); the server is the SDK's
``MODAL_SERVER_URL`` (the tests point it at a local fake).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import shlex
import time
import uuid
from typing import Any

from vime_core.sandbox.base import (
    BACKEND_LABEL,
    LABEL,
    OWNER_LABEL,
    TIMEOUT_EXIT_CODE,
    CleanupReport,
    RawExecResult,
    Sandbox,
    SandboxExpiredError,
    SandboxInfraError,
    SandboxLimits,
    owner_alive,
    owner_token,
    remote_lifetime_s,
    wrap_argv,
)
from vime_core.sandbox.cancel import finish_then_raise
from vime_sandbox_modal.flags import ModalFlags

DEFAULT_IMAGE = "python:3.12-slim"
DEFAULT_APP = "vime-sandboxes"
WALL_TIME_GRACE_S = 30  # Modal's own timeout is the wall time plus this (vime enforces the wall time itself)
EXEC_GRACE_S = 15  # Modal's exec timeout is the command's plus this (the in-sandbox `timeout` acts first)
MAX_MODAL_TIMEOUT_S = 86_400  # Modal's longest sandbox lifetime (24 h)


def _credentials(token_id: str | None, token_secret: str | None) -> tuple[str, str]:
    tid = token_id or os.environ.get("MODAL_TOKEN_ID")
    secret = token_secret or os.environ.get("MODAL_TOKEN_SECRET")
    if not (tid and secret):
        raise SandboxInfraError("modal sandbox: no credentials (set MODAL_TOKEN_ID and MODAL_TOKEN_SECRET)")
    return tid, secret


class _Sink:
    def __init__(self, limit: int) -> None:
        self.limit, self.total, self.buf = limit, 0, bytearray()

    async def drain(self, stream: Any) -> None:
        async for chunk in stream:
            data = chunk.encode() if isinstance(chunk, str) else bytes(chunk)
            self.total += len(data)
            room = self.limit - len(self.buf)
            if room > 0:
                self.buf += data[:room]


class ModalSandbox(Sandbox):
    """A sandbox on Modal (https://modal.com), through the ``modal`` SDK.

    :param image: registry image (default ``python:3.12-slim``); needs ``/bin/sh``, coreutils, ``tar``, ``python3``.
    :param app_name: Modal app the sandboxes belong to (created if missing).
    :param token_id: Modal token id (default ``MODAL_TOKEN_ID``).
    :param token_secret: Modal token secret (default ``MODAL_TOKEN_SECRET``).
    :param limits: :class:`~vime_core.sandbox.SandboxLimits`; ``cpus``, ``memory_bytes``, ``wall_time_s`` and
        ``max_output_bytes`` apply.
    :param network: give the sandbox network access (default off: ``block_network=True``).
    :param env: environment variables of every command.
    :raises SandboxInfraError: (on start) no credentials, the API refused, or the sandbox was not scheduled.
    """

    NAME = "modal"
    capabilities = frozenset({"network_isolation", "detached", "wall_time", "reaper"})
    FLAGS = ModalFlags
    FLAG_KWARGS = {"sandbox_modal_image": "image", "sandbox_modal_app": "app_name"}

    def __init__(
        self,
        *,
        image: str = DEFAULT_IMAGE,
        app_name: str = DEFAULT_APP,
        token_id: str | None = None,
        token_secret: str | None = None,
        limits: SandboxLimits | None = None,
        network: bool = False,
        env: dict[str, str] | None = None,
        default_timeout_s: float = 300.0,
    ) -> None:
        super().__init__(limits=limits, network=network, env=env, default_timeout_s=default_timeout_s)
        self.image = image
        self.app_name = app_name
        self.token_id = token_id
        self.token_secret = token_secret
        self.workspace = "/workspace"  # replaced by the sandbox's working directory at creation
        self._client: Any = None
        self._sb: Any = None
        self.modal_sandbox_id: str | None = None

    def _modal_timeout(self) -> int:
        return remote_lifetime_s(self.limits, WALL_TIME_GRACE_S, MAX_MODAL_TIMEOUT_S)

    # -- lifecycle -----------------------------------------------------------------------------------------------
    async def _create(self) -> None:
        import modal

        tid, secret = _credentials(self.token_id, self.token_secret)
        lim = self.limits

        async def create() -> None:  # recorded on self, so that a teardown after a cancelled start finds them
            self._client = await modal.Client.from_credentials.aio(tid, secret)
            app = await modal.App.lookup.aio(self.app_name, create_if_missing=True, client=self._client)
            self._sb = await modal.Sandbox.create.aio(
                "sleep",
                "infinity",
                app=app,
                image=modal.Image.from_registry(self.image),
                timeout=self._modal_timeout(),
                workdir=self.workspace,
                cpu=lim.cpus,
                memory=None if lim.memory_bytes is None else max(1, lim.memory_bytes >> 20),
                block_network=not self.network,
                tags={LABEL: self.sandbox_id, OWNER_LABEL: owner_token(), BACKEND_LABEL: self.NAME},
                client=self._client,
            )

        # requests in flight are answered before a cancellation goes on: the sandbox they made is then known and
        # terminated by close(), instead of living on at Modal until its timeout
        await finish_then_raise(create())
        self.modal_sandbox_id = self._sb.object_id
        probe = await self._exec_raw(
            ["/bin/sh", "-c", f'mkdir -p "$PWD" {shlex.quote(self.control_dir)} && pwd'],
            stdin=None,
            timeout=60.0,
            env={},
            cwd="",
            user=None,
            max_output_bytes=4096,
        )
        if probe.exit_code != 0:
            raise SandboxInfraError(f"modal sandbox {self.sandbox_id}: setup failed: {probe.stderr[-300:]!r}")
        self.workspace = probe.stdout.decode().strip() or self.workspace

    async def _destroy(self) -> None:
        sb, self._sb = self._sb, None
        if sb is not None:
            with contextlib.suppress(Exception):
                await sb.terminate.aio()
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                await client.close.aio()

    # -- exec ----------------------------------------------------------------------------------------------------
    async def _exec_raw(
        self,
        argv: list[str],
        *,
        stdin: bytes | None,
        timeout: float,
        env: dict[str, str],
        cwd: str,
        user: str | None,
        max_output_bytes: int,
    ) -> RawExecResult:
        sb = self._sb
        if sb is None:
            raise SandboxExpiredError(f"sandbox {self.sandbox_id} is closed")
        pid_file = f"{self.control_dir}/exec-{uuid.uuid4().hex[:12]}.pid"
        t0 = time.monotonic()
        proc = await sb.exec.aio(
            *wrap_argv(argv, timeout, pid_file),
            workdir=cwd or None,
            env=env or None,
            timeout=math.ceil(timeout) + EXEC_GRACE_S,
            text=False,
        )
        out, err = _Sink(max_output_bytes), _Sink(max_output_bytes)
        try:
            readers = asyncio.gather(out.drain(proc.stdout), err.drain(proc.stderr))
            if stdin is not None:
                for i in range(0, len(stdin), 1 << 20):
                    proc.stdin.write(stdin[i : i + (1 << 20)])
                    await proc.stdin.drain.aio()
            proc.stdin.write_eof()  # EOF for commands that read stdin
            await proc.stdin.drain.aio()
            await readers
            code = await proc.wait.aio()
        except asyncio.CancelledError:
            await asyncio.shield(self._kill_exec(pid_file))
            raise
        elapsed = time.monotonic() - t0
        if code == -1:  # Modal's exec deadline passed before the command ended: kill it in the sandbox
            await self._kill_exec(pid_file)
            code = TIMEOUT_EXIT_CODE
        timed_out = code == TIMEOUT_EXIT_CODE and elapsed >= timeout * 0.95
        return RawExecResult(
            int(code), bytes(out.buf), bytes(err.buf), timed_out, out.total > out.limit, err.total > err.limit
        )

    async def _kill_exec(self, pid_file: str) -> None:
        sb = self._sb
        if sb is None:
            return
        with contextlib.suppress(Exception):
            p = await sb.exec.aio(
                "/bin/sh", "-c", f"kill -9 -$(cat {shlex.quote(pid_file)}) 2>/dev/null; true", timeout=30
            )
            await p.wait.aio()

    # -- reaper --------------------------------------------------------------------------------------------------
    @classmethod
    def cleanup(
        cls,
        *,
        everything: bool = False,
        app_name: str = DEFAULT_APP,
        token_id: str | None = None,
        token_secret: str | None = None,
    ) -> CleanupReport:
        """Terminate Modal sandboxes of ``app_name`` tagged ``vime.backend=modal`` whose owner process is gone (all
        with ``everything``). Without credentials there is nothing to look at: the report is empty."""
        report = CleanupReport(cls.NAME)
        try:
            tid, secret = _credentials(token_id, token_secret)
        except SandboxInfraError:
            return report
        import modal

        client = modal.Client.from_credentials(tid, secret)
        try:
            app = modal.App.lookup(app_name, create_if_missing=True, client=client)
            for sb in modal.Sandbox.list(app_id=app.app_id, tags={BACKEND_LABEL: cls.NAME}, client=client):
                tags = sb.get_tags()
                desc = f"{sb.object_id} ({tags.get(LABEL, '?')})"
                report.found.append(desc)
                if everything or not owner_alive(tags.get(OWNER_LABEL, "")):
                    try:
                        sb.terminate()
                        report.removed.append(desc)
                    except Exception as e:  # noqa: BLE001 - report and go on
                        report.errors.append(f"{desc}: {type(e).__name__}: {e}")
        finally:
            with contextlib.suppress(Exception):
                client.close()
        return report
