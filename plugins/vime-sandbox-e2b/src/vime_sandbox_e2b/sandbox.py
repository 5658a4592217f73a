"""``E2BSandbox``: one E2B cloud sandbox per vime sandbox, through the official ``e2b`` SDK (``AsyncSandbox``).

Mapping of the contract onto E2B:

* create: ``AsyncSandbox.create(template, timeout=wall time + grace, metadata={vime labels}, envs,
  allow_internet_access=network)`` — **network off by default** (E2B's ``allow_internet_access=False``: outbound
  traffic denied; the sandbox keeps its interface, so the kit's interface check is skipped). The workspace is the
  default user's working directory as envd reports it (``/home/user`` on E2B's templates).
* exec: ``commands.run(background=True)`` of the command inside vime's :data:`~vime_core.sandbox.base.EXEC_WRAPPER`
  (coreutils ``timeout -s KILL`` in the sandbox, so a timeout kills the whole process group there), output kept up
  to ``max_output_bytes`` per stream through ``on_stdout``/``on_stderr`` (``retain_output=False``: the rest is
  dropped as it arrives), stdin through ``send_stdin``/``close_stdin``. The SDK decodes output as UTF-8 (invalid
  bytes replaced), so byte-exact data goes through the files API instead:
* files: ``files.write`` (octet-stream upload) and ``files.read(format="bytes")``; directories travel as one tar
  archive through those two calls.
* teardown: ``AsyncSandbox.kill``; E2B also deletes the sandbox by itself at its ``timeout`` (vime's wall time plus
  :data:`WALL_TIME_GRACE_S`), so nothing outlives the wall time by more than the grace even if vime is killed.
* reaper: ``AsyncSandbox.list(query=SandboxQuery(metadata={"vime.backend": "e2b"}))``; sandboxes whose
  ``vime.owner`` process is gone are killed.

Not supported by E2B per sandbox (capabilities not declared): resource limits (CPU/memory/disk come from the
template), ``exec(user=...)`` as an arbitrary user (E2B knows only ``user`` and ``root``), a read-only root.

Configuration: ``E2B_API_KEY`` (or ``api_key=``); ``E2B_DOMAIN``/``E2B_API_URL``/``E2B_SANDBOX_URL`` as the SDK
reads them (the tests point the last two at a local fake).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import shlex
import tarfile
import time
import uuid
from pathlib import Path
from typing import Any

from vime_core.sandbox.base import (
    BACKEND_LABEL,
    LABEL,
    OWNER_LABEL,
    TIMEOUT_EXIT_CODE,
    CleanupReport,
    RawExecResult,
    Sandbox,
    SandboxError,
    SandboxExpiredError,
    SandboxInfraError,
    SandboxLimits,
    extract_tar_safely,
    owner_alive,
    owner_token,
    remote_lifetime_s,
    wrap_argv,
)
from vime_core.sandbox.cancel import finish_then_raise
from vime_sandbox_e2b.flags import E2BFlags

DEFAULT_TEMPLATE = "base"
WALL_TIME_GRACE_S = 30  # E2B's own timeout is the wall time plus this (vime enforces the wall time itself)
STREAM_GRACE_S = 15.0  # the SDK stream outlives the in-sandbox `timeout` by this before vime kills from outside
MAX_E2B_TIMEOUT_S = 86_400  # E2B's longest sandbox lifetime (Pro)


class _Sink:
    """Keeps the first ``limit`` bytes of a stream, counts the rest."""

    def __init__(self, limit: int) -> None:
        self.limit, self.total, self.buf = limit, 0, bytearray()

    def add(self, text: str) -> None:
        data = text.encode("utf-8", "surrogateescape")
        self.total += len(data)
        room = self.limit - len(self.buf)
        if room > 0:
            self.buf += data[:room]


def _connection_opts(api_key: str | None, http_version: str | None) -> dict[str, Any]:
    opts: dict[str, Any] = {}
    if api_key:
        opts["api_key"] = api_key
    if http_version:
        opts["http_version"] = http_version
    return opts


class E2BSandbox(Sandbox):
    """A sandbox on E2B (https://e2b.dev), through the ``e2b`` SDK.

    :param template: E2B template name or id (default ``base``: Debian with python3, coreutils, tar).
    :param api_key: E2B API key (default: ``E2B_API_KEY``).
    :param http_version: ``"1.1"`` or ``"2"`` for the SDK's transports (default: ``E2B_HTTP_VERSION``, else 2).
    :param limits: :class:`~vime_core.sandbox.SandboxLimits`; only ``wall_time_s`` (E2B ``timeout``, capped at
        86,400 s) and ``max_output_bytes`` apply — E2B sizes CPU, memory and disk by template.
    :param network: give the sandbox internet access (default off: ``allow_internet_access=False``).
    :param env: environment variables of every command (passed to E2B as the sandbox's ``envs``).
    :raises SandboxInfraError: (on start) no API key, the API refused, or the sandbox did not come up.
    """

    NAME = "e2b"
    capabilities = frozenset({"network_isolation", "detached", "wall_time", "reaper"})
    FLAGS = E2BFlags
    FLAG_KWARGS = {"sandbox_e2b_template": "template"}

    def __init__(
        self,
        *,
        template: str = DEFAULT_TEMPLATE,
        api_key: str | None = None,
        http_version: str | None = None,
        limits: SandboxLimits | None = None,
        network: bool = False,
        env: dict[str, str] | None = None,
        default_timeout_s: float = 300.0,
    ) -> None:
        super().__init__(limits=limits, network=network, env=env, default_timeout_s=default_timeout_s)
        self.template = template
        self.api_key = api_key
        self.http_version = http_version
        self.workspace = "/home/user"  # replaced by envd's working directory at creation
        self._sbx: Any = None
        self.e2b_sandbox_id: str | None = None

    # -- lifecycle -----------------------------------------------------------------------------------------------
    def _e2b_timeout(self) -> int:
        return remote_lifetime_s(self.limits, WALL_TIME_GRACE_S, MAX_E2B_TIMEOUT_S)

    async def _create(self) -> None:
        from e2b import AsyncSandbox

        opts = _connection_opts(self.api_key, self.http_version)
        if not (opts.get("api_key") or os.environ.get("E2B_API_KEY")):
            raise SandboxInfraError("e2b sandbox: no API key (set E2B_API_KEY or pass api_key=)")

        async def create() -> None:  # recorded on self, so that a teardown after a cancelled start finds it
            self._sbx = await AsyncSandbox.create(
                template=self.template,
                timeout=self._e2b_timeout(),
                metadata={LABEL: self.sandbox_id, OWNER_LABEL: owner_token(), BACKEND_LABEL: self.NAME},
                envs=self.env or None,
                allow_internet_access=self.network,
                **opts,
            )

        # a create request in flight is answered before a cancellation goes on: the sandbox it made is then known
        # and destroyed by close(), instead of living on at E2B until its timeout
        await finish_then_raise(create())
        self.e2b_sandbox_id = self._sbx.sandbox_id
        # envd's working directory (the default user's home) is the workspace; /tmp/.vime holds exec pid files
        probe = await self._sbx.commands.run(f"mkdir -p {shlex.quote(self.control_dir)} && pwd", timeout=60)
        self.workspace = probe.stdout.strip() or self.workspace

    async def _destroy(self) -> None:
        if self._sbx is None:
            return
        sbx, self._sbx = self._sbx, None
        from e2b.exceptions import NotFoundException

        with contextlib.suppress(NotFoundException):
            await sbx.kill()

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
        from e2b.exceptions import TimeoutException

        sbx = self._require()
        pid_file = f"{self.control_dir}/exec-{uuid.uuid4().hex[:12]}.pid"
        cmd = shlex.join(wrap_argv(argv, timeout, pid_file))
        out, err = _Sink(max_output_bytes), _Sink(max_output_bytes)
        t0 = time.monotonic()
        handle = await sbx.commands.run(
            cmd,
            background=True,
            envs=env or None,
            cwd=cwd,
            user=user,  # type: ignore[arg-type] - only "user"/"root" on E2B; the capability is not declared
            stdin=stdin is not None,
            on_stdout=out.add,
            on_stderr=err.add,
            timeout=timeout + STREAM_GRACE_S,
            retain_output=False,
        )
        try:
            if stdin is not None:
                for i in range(0, len(stdin), 1 << 20):
                    await sbx.commands.send_stdin(handle.pid, stdin[i : i + (1 << 20)])
                await sbx.commands.close_stdin(handle.pid)
            try:
                result = await handle.wait()
                code = result.exit_code
            except TimeoutException:  # the stream outlived the in-sandbox timeout: kill from outside
                await self._kill_exec(pid_file, handle.pid)
                code = TIMEOUT_EXIT_CODE
            except Exception as e:
                code = getattr(e, "exit_code", None)  # CommandExitException: a non-zero exit is a result
                if code is None:
                    raise
        except asyncio.CancelledError:
            await asyncio.shield(self._kill_exec(pid_file, handle.pid))
            raise
        elapsed = time.monotonic() - t0
        timed_out = code == TIMEOUT_EXIT_CODE and elapsed >= timeout * 0.95
        return RawExecResult(
            int(code), bytes(out.buf), bytes(err.buf), timed_out, out.total > out.limit, err.total > err.limit
        )

    async def _kill_exec(self, pid_file: str, pid: int) -> None:
        sbx = self._sbx
        if sbx is None:
            return
        with contextlib.suppress(Exception):
            await sbx.commands.run(f"kill -9 -$(cat {shlex.quote(pid_file)}) 2>/dev/null; true", timeout=30)
        with contextlib.suppress(Exception):
            await sbx.commands.kill(pid)

    def _require(self) -> Any:
        if self._sbx is None:
            raise SandboxExpiredError(f"sandbox {self.sandbox_id} is closed")
        return self._sbx

    # -- files (byte-exact, through envd's files API) ------------------------------------------------------------
    async def _files_call(self, path: str, verb: str, coro: Any) -> Any:
        from e2b.exceptions import InvalidArgumentException, NotFoundException, SandboxException

        try:
            return await coro
        except NotFoundException as e:
            raise FileNotFoundError(2, f"cannot {verb} {path}: {e}", path) from e
        except InvalidArgumentException as e:
            if "directory" in str(e).lower():
                raise IsADirectoryError(21, f"cannot {verb} {path}: {e}", path) from e
            raise OSError(22, f"cannot {verb} {path}: {e}", path) from e
        except SandboxException as e:
            low = str(e).lower()
            if "permission denied" in low or "read-only" in low or "operation not permitted" in low:
                raise PermissionError(13, f"cannot {verb} {path} in the sandbox: {e}", path) from e
            if "timeout" in low or "unavailable" in low or "not running" in low or "502" in low:
                raise SandboxInfraError(f"e2b sandbox {self.sandbox_id}: {verb} {path} failed: {e}") from e
            raise OSError(5, f"cannot {verb} {path} in the sandbox: {e}", path) from e

    async def write_file(self, path: str | os.PathLike[str], data: bytes | str, *, mode: int = 0o644) -> None:
        """Write ``data`` to ``path`` through envd's files API (parents created), then ``chmod mode``.

        :raises PermissionError: the sandbox may not write there.
        :raises OSError: another failure to write, with envd's message.
        :raises SandboxInfraError: E2B failed.
        """
        self._check_usable()
        target = self._abs(path)
        blob = data.encode() if isinstance(data, str) else bytes(data)
        await self._files_call(target, "write", self._require().files.write(target, blob, use_octet_stream=True))
        if mode != 0o644:
            await self._exec_checked(["chmod", f"{mode:o}", target], timeout=60)

    async def read_file(self, path: str | os.PathLike[str], *, max_bytes: int = 1 << 30) -> bytes:
        """Read a file's bytes through envd's files API (the size is checked first with ``stat``).

        :raises FileNotFoundError: no such file.
        :raises IsADirectoryError: it is a directory.
        :raises OSError: larger than ``max_bytes``, or unreadable.
        :raises SandboxInfraError: E2B failed.
        """
        self._check_usable()
        target = self._abs(path)
        size = await self._exec_checked(
            [
                "/bin/sh",
                "-c",
                'if [ -d "$1" ]; then exit 21; fi; [ -e "$1" ] || exit 2; stat -c %s -- "$1"',
                "sh",
                target,
            ],
            timeout=60,
        )
        if size.exit_code == 2:
            raise FileNotFoundError(2, "No such file in the sandbox", target)
        if size.exit_code == 21:
            raise IsADirectoryError(21, "Is a directory", target)
        if size.exit_code == 0 and int(size.stdout.decode().strip() or 0) > max_bytes:
            raise OSError(27, f"file larger than max_bytes={max_bytes}", target)
        data = await self._files_call(target, "read", self._require().files.read(target, format="bytes"))
        return bytes(data)

    async def upload_dir(self, local: str | os.PathLike[str], remote: str) -> None:
        """Copy a host directory's contents into ``remote`` (one tar archive through the files API).

        :raises FileNotFoundError: ``local`` is not a directory.
        :raises OSError: the sandbox could not unpack it.
        :raises SandboxInfraError: E2B failed.
        """
        src = Path(local)
        if not src.is_dir():
            raise FileNotFoundError(2, "not a directory", str(src))
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for child in sorted(src.iterdir()):
                tar.add(child, arcname=child.name)
        archive = f"{self.control_dir}/upload-{uuid.uuid4().hex[:12]}.tar"
        await self.write_file(archive, buf.getvalue())
        target = self._abs(remote)
        raw = await self._exec_checked(
            [
                "/bin/sh",
                "-c",
                'mkdir -p -- "$1" && tar -x -f "$2" -C "$1"; rc=$?; rm -f "$2"; exit $rc',
                "sh",
                target,
                archive,
            ],
            timeout=300,
        )
        if raw.exit_code != 0:
            raise OSError(5, f"cannot upload to {target}: {raw.stderr.decode('utf-8', 'replace')[-300:]}", target)

    async def download_dir(self, remote: str, local: str | os.PathLike[str], *, max_bytes: int = 1 << 30) -> None:
        """Copy the contents of ``remote`` into the host directory ``local`` (tar in the sandbox, files API read).

        :raises FileNotFoundError: ``remote`` does not exist.
        :raises OSError: larger than ``max_bytes`` or unreadable.
        :raises SandboxInfraError: E2B failed.
        """
        target = self._abs(remote)
        archive = f"{self.control_dir}/download-{uuid.uuid4().hex[:12]}.tar"
        raw = await self._exec_checked(
            ["/bin/sh", "-c", '[ -d "$1" ] || exit 2; tar -c -f "$2" -C "$1" .', "sh", target, archive], timeout=300
        )
        if raw.exit_code == 2:
            raise FileNotFoundError(2, "No such directory in the sandbox", target)
        if raw.exit_code != 0:
            raise OSError(5, f"cannot download {target}: {raw.stderr.decode('utf-8', 'replace')[-300:]}", target)
        try:
            blob = await self.read_file(archive, max_bytes=max_bytes)
        finally:
            with contextlib.suppress(SandboxError):
                await self._exec_checked(["rm", "-f", archive], timeout=60)
        extract_tar_safely(blob, Path(local))

    # -- reaper --------------------------------------------------------------------------------------------------
    @classmethod
    def cleanup(cls, *, everything: bool = False, api_key: str | None = None) -> CleanupReport:
        """Kill E2B sandboxes labelled ``vime.backend=e2b`` whose owner process is gone (all with ``everything``).

        Without an API key there is nothing to look at: the report is empty.
        """
        report = CleanupReport(cls.NAME)
        key = api_key or os.environ.get("E2B_API_KEY")
        if not key:
            return report
        from e2b import Sandbox as SyncSandbox
        from e2b import SandboxQuery

        pager = SyncSandbox.list(query=SandboxQuery(metadata={BACKEND_LABEL: cls.NAME}), api_key=key)
        while True:
            for info in pager.next_items():
                meta = info.metadata or {}
                desc = f"{info.sandbox_id} ({meta.get(LABEL, '?')})"
                report.found.append(desc)
                if everything or not owner_alive(meta.get(OWNER_LABEL, "")):
                    try:
                        SyncSandbox.kill(info.sandbox_id, api_key=key)
                        report.removed.append(desc)
                    except Exception as e:  # noqa: BLE001 - report and go on
                        report.errors.append(f"{desc}: {type(e).__name__}: {e}")
            if not pager.has_next:
                break
        return report
