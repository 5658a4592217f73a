"""The sandbox contract: an async context manager that runs untrusted commands and always tears down.

Every backend subclasses :class:`Sandbox` and implements :meth:`Sandbox._create`, :meth:`Sandbox._destroy`,
:meth:`Sandbox._exec_raw` and (class level) :meth:`Sandbox.cleanup`; ``exec`` with output limits, files,
directories, detached commands, wall time and error classification are written once here on top of them. The
errors, results, limits, owner tokens, reaper and tar helpers have a module each and are re-exported here. The
contract, its errors and leftovers: docs/sandboxes.md.
"""

from __future__ import annotations

import abc
import asyncio
import io
import logging
import os
import shlex
import tarfile
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import ClassVar

from vime_core.sandbox.cancel import finish_then_raise
from vime_core.sandbox.construction import SandboxConstruction

# Re-exported: the errors, results, limits, owner tokens, reaper and tar helpers lived in this module; plugins and
# callers import them from here (``from vime_core.sandbox.base import SandboxInfraError, owner_token``).
from vime_core.sandbox.errors import SandboxError, SandboxExpiredError, SandboxInfraError
from vime_core.sandbox.limits import (
    SandboxLimits,
    backend_kwargs,
    backend_kwargs_from_args,
    remote_lifetime_s,
    sandbox_kwargs,
    sandbox_kwargs_from_args,
    sandbox_kwargs_from_config,
)
from vime_core.sandbox.owner import (
    BACKEND_LABEL,
    LABEL,
    OWNER_LABEL,
    _boot_id,
    owner_alive,
    owner_token,
    process_start_time,
    processes_with_env,
)
from vime_core.sandbox.reaper import forget_reaps, live_sandboxes, reap_once
from vime_core.sandbox.results import TIMEOUT_EXIT_CODE, CleanupReport, DetachedProcess, ExecResult, RawExecResult
from vime_core.sandbox.tar import extract_tar_safely

__all__ = [
    "BACKEND_LABEL",
    "CAPABILITIES",
    "CONTROL_DIR",
    "EXEC_WRAPPER",
    "LABEL",
    "OWNER_LABEL",
    "SANDBOX_AGENTS_DIR",
    "TIMEOUT_EXIT_CODE",
    "CleanupReport",
    "DetachedProcess",
    "ExecResult",
    "RawExecResult",
    "Sandbox",
    "SandboxError",
    "SandboxExpiredError",
    "SandboxInfraError",
    "SandboxLimits",
    "_boot_id",
    "agents_cache_dir",
    "backend_kwargs",
    "backend_kwargs_from_args",
    "extract_tar_safely",
    "forget_reaps",
    "owner_alive",
    "owner_token",
    "process_start_time",
    "processes_with_env",
    "remote_lifetime_s",
    "sandbox_kwargs",
    "sandbox_kwargs_from_args",
    "sandbox_kwargs_from_config",
    "wrap_argv",
]

logger = logging.getLogger("vime.sandbox")

CONTROL_DIR = "/tmp/.vime"  # where the default detached-command implementation keeps its files, inside the sandbox
#: where backends that can mount host directories show :func:`agents_cache_dir` (read-only) inside the sandbox
SANDBOX_AGENTS_DIR = "/opt/vime/agents"


def agents_cache_dir() -> Path:
    """Host directory of prepared agent CLIs (``vime agent prepare``): ``$VIME_CACHE_DIR/agents``, default
    ``~/.cache/vime/agents``. Backends that can mount host directories show it read-only at
    :data:`SANDBOX_AGENTS_DIR`; the ``local`` backend sees it at its host path."""
    return Path(os.environ.get("VIME_CACHE_DIR", Path.home() / ".cache" / "vime")) / "agents"


# Shell wrapper for backends whose exec has no timeout or process-group control of its own (docker, SSH): runs
# argv ($3...) with coreutils `timeout -s KILL $1` in a process group of its own, writes that group's id to the file
# $2 (so that the command can be killed from outside), kills what the command left in its group when it exits, and
# passes stdin through (fd 3). Needs /bin/sh and coreutils in the sandbox.
EXEC_WRAPPER = (
    'exec 3<&0; t=$1; f=$2; shift 2; mkdir -p -m 1777 "${f%/*}" 2>/dev/null; timeout -s KILL "$t" "$@" <&3 & '
    'pid=$!; echo $pid 2>/dev/null >"$f"; wait $pid 2>/dev/null; rc=$?; kill -9 -$pid 2>/dev/null; '
    'rm -f "$f" 2>/dev/null; exit $rc'
)


def wrap_argv(argv: list[str], timeout_s: float, pid_file: str) -> list[str]:
    """``argv`` inside :data:`EXEC_WRAPPER` with a timeout in seconds; ``kill -9 -$(cat pid_file)`` kills it."""
    return ["/bin/sh", "-c", EXEC_WRAPPER, "sh", f"{timeout_s:.3f}", pid_file, *argv]


# Capability names used by the contract kit (vime_core.testing.SandboxBackendContract).
CAPABILITIES = frozenset(
    {
        "network_isolation",  # network off by default, on with network=True
        "resource_limits",  # memory/pids/file-size limits enforced
        "filesystem_isolation",  # cannot write outside the workspace (and /tmp)
        "user",  # exec(user=...) runs as another user
        "detached",  # start_detached/poll/wait/kill
        "wall_time",  # the whole sandbox is killed at limits.wall_time_s
        "reaper",  # cleanup() finds resources of dead owners
        "host_port",  # expose_host_port(): a host service on 127.0.0.1 reachable from inside, network still off
    }
)


class Sandbox(SandboxConstruction, abc.ABC):
    """An isolated place to run commands: ``async with Backend(...) as sb: await sb.exec("...")``.

    Created on ``__aenter__``; torn down on ``__aexit__`` — also on exception, cancellation and timeout; at
    interpreter exit for sandboxes still open; and by :meth:`cleanup` for those of a process that was killed.

    :param limits: resource limits (:class:`SandboxLimits`; its defaults when ``None``).
    :param network: ``True`` to give the sandbox network access; off by default.
    :param env: environment variables for every command.
    :param default_timeout_s: timeout of ``exec`` calls that give none, in seconds.

    Backends set :attr:`NAME`, :attr:`workspace` (the default working directory inside the sandbox) and
    implement :meth:`_create`, :meth:`_destroy`, :meth:`_exec_raw` and :meth:`cleanup`; a run builds them with
    :meth:`~vime_core.sandbox.construction.SandboxConstruction.from_context`.
    """

    NAME: ClassVar[str] = ""
    capabilities: ClassVar[frozenset[str]] = frozenset()
    control_dir: ClassVar[str] = CONTROL_DIR

    def __init__(
        self,
        *,
        limits: SandboxLimits | None = None,
        network: bool = False,
        env: Mapping[str, str] | None = None,
        default_timeout_s: float = 300.0,
    ) -> None:
        self.limits = limits if limits is not None else SandboxLimits()
        self.network = bool(network)
        self.env = dict(env or {})
        self.default_timeout_s = float(default_timeout_s)
        self.sandbox_id = f"vime-{self.NAME or 'sbx'}-{uuid.uuid4().hex[:12]}"
        self.workspace = "/workspace"
        self._state = "new"  # new | started | closed
        self._deadline: float | None = None
        self._close_task: asyncio.Future | None = None

    # -- lifecycle -----------------------------------------------------------------------------------------------
    async def __aenter__(self) -> Sandbox:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Create the sandbox.

        :raises SandboxInfraError: creation failed (whatever was created is destroyed first).
        :raises SandboxError: started twice.
        """
        if self._state != "new":
            raise SandboxError(f"sandbox {self.sandbox_id} is {self._state}; a sandbox starts once")
        await reap_once(type(self))
        self._state = "started"
        live_sandboxes.add(self)
        try:
            await self._create()
        except BaseException as e:
            await self.close()
            if isinstance(e, (SandboxError, asyncio.CancelledError, KeyboardInterrupt)):
                raise
            raise SandboxInfraError(f"{self.NAME} sandbox {self.sandbox_id}: creation failed: {e}") from e
        if self.limits.wall_time_s is not None:
            self._deadline = time.monotonic() + self.limits.wall_time_s

    async def close(self) -> None:
        """Destroy the sandbox and everything in it; idempotent; completes even if the caller is cancelled.

        Teardown errors are logged, not raised (the reaper retries them).
        """
        if self._state == "new":
            self._state = "closed"
            return
        if self._close_task is None:
            self._state = "closed"
            self._close_task = asyncio.ensure_future(self._destroy_logged())
        if not self._close_task.done():
            await finish_then_raise(self._close_task)

    async def _destroy_logged(self) -> None:
        try:
            await self._destroy()
        except Exception as e:  # noqa: BLE001
            logger.warning("%s sandbox %s: teardown failed (the reaper will retry): %s", self.NAME, self.sandbox_id, e)
        finally:
            live_sandboxes.discard(self)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run (or started)."""
        return self._state == "closed"

    def remaining_s(self) -> float | None:
        """Seconds left before the wall-time limit, or ``None`` without one."""
        return None if self._deadline is None else self._deadline - time.monotonic()

    def _check_usable(self) -> None:
        if self._state == "new":
            raise SandboxError(f"sandbox {self.sandbox_id} is not started (use `async with`)")
        if self._state == "closed":
            raise SandboxExpiredError(f"sandbox {self.sandbox_id} is closed")
        left = self.remaining_s()
        if left is not None and left <= 0:
            raise SandboxExpiredError(
                f"sandbox {self.sandbox_id} reached its wall-time limit of {self.limits.wall_time_s} s"
            )

    # -- exec ----------------------------------------------------------------------------------------------------
    async def exec(
        self,
        cmd: str | Sequence[str],
        *,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        stdin: bytes | None = None,
        max_output_bytes: int | None = None,
    ) -> ExecResult:
        """Run a command and wait for it.

        :param cmd: a shell command line (run by ``/bin/sh -c``) or an argv list.
        :param timeout: seconds before the command is killed (``timed_out=True``); default
            ``default_timeout_s``, never beyond the wall-time limit.
        :param env: extra environment variables (over the sandbox's ``env``).
        :param cwd: working directory inside the sandbox; default :attr:`workspace`.
        :param user: user name or uid to run as (backends with the ``user`` capability).
        :param stdin: bytes fed to the command's standard input.
        :param max_output_bytes: bytes kept per stream; default ``limits.max_output_bytes``.
        :returns: the :class:`ExecResult` (a non-zero exit is not an error).
        :raises SandboxInfraError: the backend failed to run the command at all.
        :raises SandboxExpiredError: the sandbox is closed or past its wall-time limit.
        """
        argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        t0 = time.monotonic()
        raw = await self._exec_checked(
            argv, stdin=stdin, timeout=timeout, env=env, cwd=cwd, user=user, max_output_bytes=max_output_bytes
        )
        return raw.decode(time.monotonic() - t0)

    async def _exec_checked(
        self,
        argv: list[str],
        *,
        stdin: bytes | None = None,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        max_output_bytes: int | None = None,
    ) -> RawExecResult:
        self._check_usable()
        if user is not None and "user" not in self.capabilities:
            raise SandboxError(f"the {self.NAME} backend cannot run commands as another user")
        timeout = self.default_timeout_s if timeout is None else float(timeout)
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        left = self.remaining_s()
        capped = left is not None and left < timeout
        if capped:
            timeout = max(left, 0.001)
        merged_env = {**self.env, **(env or {})}
        limit = self.limits.max_output_bytes if max_output_bytes is None else int(max_output_bytes)
        try:
            raw = await self._exec_raw(
                argv,
                stdin=stdin,
                timeout=timeout,
                env=merged_env,
                cwd=cwd or self.workspace,
                user=user,
                max_output_bytes=limit,
            )
        except (SandboxError, asyncio.CancelledError):
            raise
        except Exception as e:
            left = self.remaining_s()
            if left is not None and left <= 0:
                raise SandboxExpiredError(f"sandbox {self.sandbox_id} reached its wall-time limit: {e}") from e
            raise SandboxInfraError(f"{self.NAME} sandbox {self.sandbox_id}: exec failed: {e}") from e
        if capped and raw.exit_code == TIMEOUT_EXIT_CODE:
            raw = RawExecResult(
                TIMEOUT_EXIT_CODE, raw.stdout, raw.stderr, True, raw.stdout_truncated, raw.stderr_truncated
            )
        return raw

    # -- files ---------------------------------------------------------------------------------------------------
    def _abs(self, path: str | os.PathLike[str]) -> str:
        p = os.fspath(path)
        return p if p.startswith("/") else f"{self.workspace.rstrip('/')}/{p}"

    async def write_file(self, path: str | os.PathLike[str], data: bytes | str, *, mode: int = 0o644) -> None:
        """Write ``data`` to ``path`` (relative paths are under :attr:`workspace`), creating parent directories.

        :raises PermissionError: the sandbox may not write there (read-only or outside the workspace).
        :raises OSError: another failure to write, with the sandbox's message.
        :raises SandboxInfraError: the backend failed.
        """
        blob = data.encode() if isinstance(data, str) else bytes(data)
        target = self._abs(path)
        script = 'set -e; d=$(dirname -- "$1"); mkdir -p -- "$d"; cat > "$1"; chmod "$2" "$1"'
        raw = await self._exec_checked(
            ["/bin/sh", "-c", script, "sh", target, f"{mode:o}"], stdin=blob, max_output_bytes=65536
        )
        if raw.exit_code != 0:
            _raise_file_error(raw.stderr.decode("utf-8", "replace"), target, "write")

    async def read_file(self, path: str | os.PathLike[str], *, max_bytes: int = 1 << 30) -> bytes:
        """Read a file's bytes (relative paths are under :attr:`workspace`).

        :param max_bytes: refuse files larger than this, in bytes.
        :raises FileNotFoundError: no such file.
        :raises IsADirectoryError: it is a directory.
        :raises OSError: larger than ``max_bytes``, or unreadable (with the sandbox's message).
        :raises SandboxInfraError: the backend failed.
        """
        target = self._abs(path)
        script = 'if [ -d "$1" ]; then exit 21; fi; if [ ! -e "$1" ]; then exit 2; fi; exec cat -- "$1"'
        raw = await self._exec_checked(["/bin/sh", "-c", script, "sh", target], max_output_bytes=max_bytes)
        if raw.exit_code == 2:
            raise FileNotFoundError(2, "No such file in the sandbox", target)
        if raw.exit_code == 21:
            raise IsADirectoryError(21, "Is a directory", target)
        if raw.exit_code != 0:
            _raise_file_error(raw.stderr.decode("utf-8", "replace"), target, "read")
        if raw.stdout_truncated:
            raise OSError(27, f"file larger than max_bytes={max_bytes}", target)
        return raw.stdout

    async def upload_dir(self, local: str | os.PathLike[str], remote: str) -> None:
        """Copy a host directory's contents into ``remote`` inside the sandbox (created if missing).

        :raises FileNotFoundError: ``local`` is not a directory.
        :raises OSError: the sandbox could not unpack it (message included).
        :raises SandboxInfraError: the backend failed.
        """
        src = Path(local)
        if not src.is_dir():
            raise FileNotFoundError(2, "not a directory", str(src))
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for child in sorted(src.iterdir()):
                tar.add(child, arcname=child.name)
        target = self._abs(remote)
        raw = await self._exec_checked(
            ["/bin/sh", "-c", 'mkdir -p -- "$1" && tar -x -f - -C "$1"', "sh", target],
            stdin=buf.getvalue(),
            max_output_bytes=65536,
        )
        if raw.exit_code != 0:
            _raise_file_error(raw.stderr.decode("utf-8", "replace"), target, "upload to")

    async def download_dir(self, remote: str, local: str | os.PathLike[str], *, max_bytes: int = 1 << 30) -> None:
        """Copy the contents of ``remote`` (a directory in the sandbox) into the host directory ``local``.

        Links and special files are skipped; nothing is written outside ``local``.

        :param max_bytes: refuse archives larger than this, in bytes.
        :raises FileNotFoundError: ``remote`` does not exist.
        :raises OSError: larger than ``max_bytes`` or unreadable.
        :raises SandboxInfraError: the backend failed.
        """
        target = self._abs(remote)
        script = 'if [ ! -d "$1" ]; then exit 2; fi; exec tar -c -f - -C "$1" .'
        raw = await self._exec_checked(["/bin/sh", "-c", script, "sh", target], max_output_bytes=max_bytes)
        if raw.exit_code == 2:
            raise FileNotFoundError(2, "No such directory in the sandbox", target)
        if raw.exit_code != 0:
            _raise_file_error(raw.stderr.decode("utf-8", "replace"), target, "download from")
        if raw.stdout_truncated:
            raise OSError(27, f"directory archive larger than max_bytes={max_bytes}", target)
        extract_tar_safely(raw.stdout, Path(local))

    # -- detached commands ---------------------------------------------------------------------------------------
    async def start_detached(
        self,
        cmd: str,
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        timeout: float | None = None,
    ) -> DetachedProcess:
        """Start a long-running shell command in the background and return at once.

        Its output goes to files in the sandbox (bounded by the sandbox's disk limit); :meth:`poll` reads back at
        most ``max_output_bytes`` of each stream.

        :param timeout: seconds after which it is killed (``timed_out=True`` in its result), or ``None``.
        :raises SandboxInfraError: the backend failed.
        """
        pid_ = uuid.uuid4().hex[:12]
        ctl = f"{self.control_dir}/{pid_}"
        inner = cmd if timeout is None else f"exec timeout -s KILL {float(timeout):.3f} /bin/sh -c {shlex.quote(cmd)}"
        # the runner stays outside the command's process group so that it survives kill() and records the status
        runner = (
            f"s=$(date +%s.%N); setsid /bin/sh -c {shlex.quote(inner)} < /dev/null > {ctl}.out 2> {ctl}.err & "
            f"echo $! > {ctl}.pid.tmp; mv {ctl}.pid.tmp {ctl}.pid; wait $!; rc=$?; "
            f'echo "$rc $s $(date +%s.%N)" > {ctl}.rc.tmp; mv {ctl}.rc.tmp {ctl}.rc'
        )
        script = (
            f'mkdir -p {self.control_dir} && cd "$1" && {{ setsid /bin/sh -c {shlex.quote(runner)} '
            f"< /dev/null > /dev/null 2>&1 & }}; i=0; while [ ! -f {ctl}.pid ] && [ $i -lt 1000 ]; do "
            f"sleep 0.01; i=$((i+1)); done; cat {ctl}.pid"
        )
        raw = await self._exec_checked(
            ["/bin/sh", "-c", script, "sh", cwd or self.workspace],
            env=env,
            user=user,
            timeout=30.0,
            max_output_bytes=4096,
        )
        try:
            pid = int(raw.stdout.decode().strip())
        except ValueError:
            raise SandboxInfraError(
                f"{self.NAME} sandbox {self.sandbox_id}: could not start detached command: "
                f"exit {raw.exit_code}, {raw.stderr.decode('utf-8', 'replace')[-500:]}"
            ) from None
        return DetachedProcess(pid_, pid, time.monotonic(), timeout)

    async def poll(self, proc: DetachedProcess) -> ExecResult | None:
        """The result of a detached command if it has finished, else ``None``.

        :raises SandboxInfraError: the backend failed.
        """
        ctl = f"{self.control_dir}/{proc.id}"
        limit = self.limits.max_output_bytes
        script = (
            f"if [ ! -f {ctl}.rc ]; then exit 3; fi; cat {ctl}.rc; "
            f"wc -c < {ctl}.out; wc -c < {ctl}.err; head -c {limit} {ctl}.out; head -c {limit} {ctl}.err >&2"
        )
        raw = await self._exec_checked(["/bin/sh", "-c", script], timeout=60.0, max_output_bytes=2 * limit + 4096)
        if raw.exit_code == 3:
            return None
        if raw.exit_code != 0:
            raise SandboxInfraError(f"{self.NAME} sandbox {self.sandbox_id}: poll failed: {raw.stderr[-500:]!r}")
        head, _, rest = raw.stdout.partition(b"\n")
        n_out, _, rest = rest.partition(b"\n")
        n_err, _, out = rest.partition(b"\n")
        fields = head.split()
        code, n_out_i, n_err_i = int(fields[0]), int(n_out), int(n_err)
        elapsed = time.monotonic() - proc.started_at
        try:  # the command's own run time, measured in the sandbox (the host's view starts later)
            ran_s = float(fields[2]) - float(fields[1])
        except (IndexError, ValueError):
            ran_s = elapsed
        timed_out = proc.timeout is not None and code == TIMEOUT_EXIT_CODE and ran_s >= proc.timeout * 0.95
        return RawExecResult(code, out, raw.stderr, timed_out, n_out_i > limit, n_err_i > limit).decode(elapsed)

    async def wait(
        self, proc: DetachedProcess, *, timeout: float | None = None, poll_interval_s: float = 0.2
    ) -> ExecResult:
        """Poll a detached command until it finishes.

        :param timeout: seconds to wait; on expiry the command is killed and its result returned.
        :raises SandboxInfraError: the backend failed.
        """
        t_end = None if timeout is None else time.monotonic() + timeout
        interval = min(0.05, poll_interval_s)
        while True:
            result = await self.poll(proc)
            if result is not None:
                return result
            if t_end is not None and time.monotonic() >= t_end:
                await self.kill(proc)
                for _ in range(50):
                    result = await self.poll(proc)
                    if result is not None:
                        return ExecResult(
                            TIMEOUT_EXIT_CODE,
                            result.stdout,
                            result.stderr,
                            True,
                            result.stdout_truncated,
                            result.stderr_truncated,
                            result.duration_s,
                        )
                    await asyncio.sleep(0.1)
                raise SandboxInfraError(f"{self.NAME} sandbox {self.sandbox_id}: detached command did not die")
            await asyncio.sleep(interval)
            interval = min(interval * 2, poll_interval_s)

    async def kill(self, proc: DetachedProcess) -> None:
        """Kill a detached command's process group (no error if it already finished).

        :raises SandboxInfraError: the backend failed.
        """
        await self._exec_checked(["/bin/sh", "-c", f"kill -9 -{int(proc.pid)} 2>/dev/null; true"], timeout=30.0)

    # -- backend interface ---------------------------------------------------------------------------------------
    async def expose_host_port(self, port: int, host: str = "127.0.0.1") -> str:
        """Make the host service at ``host:port`` (TCP, e.g. the agent gateway) reachable from inside the sandbox,
        without giving the sandbox any other network.

        :return: ``"HOST:PORT"`` to connect to from inside the sandbox.
        :raises NotImplementedError: the backend cannot (capability ``"host_port"`` not declared).
        :raises SandboxInfraError: setting up the forward failed.
        """
        raise NotImplementedError(f"the {self.NAME} sandbox backend cannot expose host ports")

    @abc.abstractmethod
    async def _create(self) -> None:
        """Create the sandbox's resources, labelled with :data:`LABEL` = ``sandbox_id`` and :data:`OWNER_LABEL`.

        Exceptions become :class:`SandboxInfraError` (after :meth:`_destroy` ran).
        """

    @abc.abstractmethod
    async def _destroy(self) -> None:
        """Destroy every resource of the sandbox. Must tolerate a partial :meth:`_create`, and being called twice."""

    def _destroy_sync(self) -> None:
        """Synchronous best-effort teardown, used at interpreter exit when no event loop can run ``_destroy``."""
        logger.warning("%s sandbox %s: open at interpreter exit; the reaper removes it", self.NAME, self.sandbox_id)

    @abc.abstractmethod
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
        """Run ``argv`` in the sandbox; keep at most ``max_output_bytes`` bytes of each stream (drain the rest).

        On timeout kill the command and return ``exit_code=TIMEOUT_EXIT_CODE, timed_out=True``. If the caller is
        cancelled, kill the command before re-raising. Raise (any exception) only for infrastructure failures.
        """

    @classmethod
    @abc.abstractmethod
    def cleanup(cls, *, everything: bool = False) -> CleanupReport:
        """Find this backend's resources carrying the vime label and remove those whose owner process is gone.

        :param everything: remove all of them, including those of running vime processes.
        """


def _raise_file_error(stderr: str, path: str, verb: str) -> None:
    low = stderr.lower()
    if "read-only" in low or "permission denied" in low or "operation not permitted" in low:
        raise PermissionError(13, f"cannot {verb} {path} in the sandbox: {stderr.strip()[-300:]}", path)
    if "no such file" in low:
        raise FileNotFoundError(2, f"cannot {verb} {path}: {stderr.strip()[-300:]}", path)
    raise OSError(5, f"cannot {verb} {path} in the sandbox: {stderr.strip()[-300:]}", path)
