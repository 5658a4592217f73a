"""``DockerSandbox``: one container per sandbox, through the ``docker`` SDK against a real dockerd.

Each sandbox is a container of a local image (default ``vime-sandbox:bookworm``, built without any registry by
:mod:`vime_sandbox_docker.image`) whose main process is ``sleep <wall time>`` under docker's init, so the daemon
itself stops (and, with ``AutoRemove``, deletes) it at the wall-time limit even if vime is gone. Defaults:
``--network none``, read-only root filesystem with a tmpfs ``/tmp`` and a volume on ``/workspace``, memory (no
swap), CPU quota, pids limit, file-size and open-file ulimits, ``no-new-privileges``, and the labels
``vime.sandbox=<id>``, ``vime.owner=<host:boot:pid:start>``, ``vime.backend=docker`` on the container and its
volume. :meth:`DockerSandbox.cleanup` removes containers and volumes whose owner process is gone.

Host ports (:meth:`DockerSandbox.expose_host_port`): with a local daemon every container gets a read-only bind
mount of a host directory of its own (``/var/tmp/vime-docker-<uid>/<id>`` at :data:`HOST_SOCKET_DIR`); a host port
is exposed as a unix socket there (served by :class:`~vime_core.sandbox.forward.UnixToTcpForwarder`) plus a Python
forwarder inside listening on the container's ``127.0.0.1:<port>`` — the container keeps ``--network none``. Agent
CLIs prepared on the host (``vime agent prepare``, :func:`vime_core.sandbox.base.agents_cache_dir`) are mounted
read-only at :data:`vime_core.sandbox.base.SANDBOX_AGENTS_DIR` when that directory exists.

Commands run through ``docker exec`` wrapped in ``/bin/sh``: coreutils ``timeout`` kills the command's process group
at its timeout, and whatever the command left in its group is killed when it exits, so ``exec`` returns when the
command does. The image needs ``/bin/sh``, coreutils, ``setsid``, ``tar`` and ``sleep``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import math
import os
import shutil
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vime_core.config import PluginConfig, flag
from vime_core.sandbox.base import (
    BACKEND_LABEL,
    LABEL,
    OWNER_LABEL,
    SANDBOX_AGENTS_DIR,
    TIMEOUT_EXIT_CODE,
    CleanupReport,
    RawExecResult,
    Sandbox,
    SandboxExpiredError,
    SandboxInfraError,
    SandboxLimits,
    agents_cache_dir,
    owner_alive,
    owner_token,
    wrap_argv,
)
from vime_core.sandbox.cancel import finish_then_raise, wait_for

DEFAULT_IMAGE = "vime-sandbox:bookworm"
HOST_SOCKET_DIR = "/run/vime-host"  # in the container: read-only bind mount holding the host-port unix sockets
_API_VERSION: dict[str, str] = {}
# docker-py is blocking: short calls run on this pool (not asyncio's small default one, which long-running exec
# streams of many sandboxes would exhaust); each exec's output stream gets a thread of its own
_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="vime-docker")


@dataclass(frozen=True, kw_only=True)
class DockerFlags(PluginConfig):
    """The ``--sandbox-docker-*`` flags, registered through ``vime_register_flags``."""

    PREFIX = "sandbox-docker"
    TITLE = "vime-sandbox-docker"

    sandbox_docker_image: str = flag(
        default=DEFAULT_IMAGE, help="local image of docker sandboxes (build it with `vime-sandbox-docker build-image`)"
    )
    sandbox_docker_host: str | None = flag(
        default=None, help="docker daemon address (default: DOCKER_HOST or the local socket)"
    )
    sandbox_docker_writable_root: bool = flag(
        action="store_true", help="writable root filesystem (default: read-only except /workspace and /tmp)"
    )


async def _call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    return await asyncio.get_running_loop().run_in_executor(_POOL, functools.partial(fn, *args, **kwargs))


def _in_thread(fn: Any) -> asyncio.Future:
    """Run ``fn`` on a dedicated daemon thread; the returned future completes with its result."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()

    def target() -> None:
        try:
            result = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            loop.call_soon_threadsafe(lambda exc=e: fut.done() or fut.set_exception(exc))
        else:
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(result))

    threading.Thread(target=target, daemon=True, name="vime-docker-exec").start()
    return fut


def host_dirs_root() -> Path:
    """Host directory holding one directory per container for its host-port sockets (``VIME_DOCKER_HOST_DIR``
    overrides; default ``/var/tmp/vime-docker-<uid>``)."""
    env = os.environ.get("VIME_DOCKER_HOST_DIR")
    return Path(env) if env else Path("/var/tmp") / f"vime-docker-{os.getuid()}"


def _daemon_is_local(client: Any) -> bool:
    """Whether the daemon shares this machine's filesystem (a unix socket), so that bind mounts work."""
    base = str(getattr(client.api, "base_url", ""))
    return base.startswith("http+docker://") or base.startswith("unix:")


def docker_client(base_url: str | None = None, timeout_s: float = 120.0) -> Any:
    """A ``docker.DockerClient`` for ``base_url`` (default: ``DOCKER_HOST`` or the local socket).

    :raises docker.errors.DockerException: the daemon is unreachable.
    """
    import docker

    key = base_url or ""
    if key in _API_VERSION:
        if base_url:
            return docker.DockerClient(base_url=base_url, version=_API_VERSION[key], timeout=int(timeout_s))
        return docker.from_env(version=_API_VERSION[key], timeout=int(timeout_s))
    client = (
        docker.DockerClient(base_url=base_url, timeout=int(timeout_s))
        if base_url
        else docker.from_env(timeout=int(timeout_s))
    )
    _API_VERSION[key] = client.api.api_version
    return client


class _Sink:
    def __init__(self, limit: int) -> None:
        self.limit, self.buf, self.total = limit, bytearray(), 0

    def add(self, chunk: bytes) -> None:
        room = self.limit - len(self.buf)
        if room > 0:
            self.buf += chunk[:room]
        self.total += len(chunk)


class DockerSandbox(Sandbox):
    """A container per sandbox (see the module docstring).

    :param image: image name; must exist locally (``vime-sandbox-docker build-image`` makes the default one).
    :param limits: resource limits (``disk_bytes``: ``/tmp`` tmpfs size and the largest file, by ulimit ``fsize``).
    :param network: attach the default bridge network instead of ``none``.
    :param env: environment of every command.
    :param default_timeout_s: default ``exec`` timeout in seconds.
    :param read_only: read-only root filesystem (only ``/workspace`` and ``/tmp`` writable).
    :param base_url: docker daemon address (default ``DOCKER_HOST`` or ``unix:///var/run/docker.sock``).
    :param run_kwargs: extra ``containers.run`` keywords (e.g. ``runtime="runsc"``), applied last.
    """

    NAME = "docker"
    capabilities = frozenset(
        {
            "network_isolation",
            "resource_limits",
            "filesystem_isolation",
            "user",
            "detached",
            "wall_time",
            "reaper",
            "host_port",
        }
    )

    #: ``--sandbox-docker-image`` and ``--sandbox-docker-host`` (unset or empty: the constructor's default)
    FLAGS = DockerFlags
    FLAG_KWARGS = {"sandbox_docker_image": "image", "sandbox_docker_host": "base_url"}

    def __init__(
        self,
        *,
        image: str = DEFAULT_IMAGE,
        limits: SandboxLimits | None = None,
        network: bool = False,
        env: dict[str, str] | None = None,
        default_timeout_s: float = 300.0,
        read_only: bool = True,
        base_url: str | None = None,
        run_kwargs: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(limits=limits, network=network, env=env, default_timeout_s=default_timeout_s)
        self.image = image
        self.read_only = read_only
        self.base_url = base_url
        self.run_kwargs = dict(run_kwargs or {})
        self.workspace = "/workspace"
        self._client: Any = None
        self._container: Any = None
        self._lock = threading.Lock()
        self._host_dir: Path | None = None
        self._forwards: dict[tuple[str, int], tuple[Any, str]] = {}

    @classmethod
    def from_config(cls, sandbox: Any = None, flags: Any = None, **kwargs: Any) -> DockerSandbox:
        """The generic ``--sandbox-*`` limits plus ``--sandbox-docker-image``, ``--sandbox-docker-host``
        (:attr:`FLAG_KWARGS`) and ``--sandbox-docker-writable-root`` of ``flags`` (a :class:`DockerFlags`; ``None``:
        the defaults). Keywords win."""
        writable = (flags or DockerFlags()).sandbox_docker_writable_root
        return super().from_config(sandbox, flags, **{"read_only": not writable, **kwargs})  # type: ignore[return-value]

    @property
    def container_id(self) -> str | None:
        return None if self._container is None else self._container.id

    # -- lifecycle -----------------------------------------------------------------------------------------------
    def _labels(self) -> dict[str, str]:
        return {LABEL: self.sandbox_id, OWNER_LABEL: owner_token(), BACKEND_LABEL: self.NAME}

    def _create_sync(self) -> None:
        import docker
        from docker.types import Mount, Ulimit

        try:
            self._client = docker_client(self.base_url)
        except docker.errors.DockerException as e:
            raise SandboxInfraError(f"docker daemon unreachable: {e}") from e
        try:
            self._client.images.get(self.image)
        except docker.errors.ImageNotFound:
            raise SandboxInfraError(
                f"docker image {self.image!r} not found; build it with `vime-sandbox-docker build-image "
                f"--tag {self.image}` (no registry needed)"
            ) from None
        lim = self.limits
        labels = self._labels()
        wall = "infinity" if lim.wall_time_s is None else str(math.ceil(lim.wall_time_s) + 1)
        ulimits = [Ulimit(name="core", soft=0, hard=0)]
        if lim.disk_bytes:
            ulimits.append(Ulimit(name="fsize", soft=lim.disk_bytes, hard=lim.disk_bytes))
        if lim.open_files:
            ulimits.append(Ulimit(name="nofile", soft=lim.open_files, hard=lim.open_files))
        tmp_size = f"size={lim.disk_bytes}" if lim.disk_bytes else "size=1g"
        kwargs: dict[str, Any] = dict(
            command=["sleep", wall],
            detach=True,
            name=self.sandbox_id,
            hostname="sandbox",
            labels=labels,
            init=True,
            auto_remove=True,
            network_mode="bridge" if self.network else "none",
            read_only=self.read_only,
            tmpfs={"/tmp": f"{tmp_size},mode=1777"},
            mounts=self._mounts(Mount, labels),
            working_dir=self.workspace,
            environment={"HOME": self.workspace, "LANG": "C.UTF-8"},
            ulimits=ulimits,
            security_opt=["no-new-privileges"],
            cap_drop=["NET_RAW", "MKNOD", "AUDIT_WRITE", "SETFCAP", "SYS_CHROOT"],
        )
        if lim.memory_bytes:
            kwargs.update(mem_limit=lim.memory_bytes, memswap_limit=lim.memory_bytes)
        if lim.cpus:
            kwargs["nano_cpus"] = int(lim.cpus * 1e9)
        if lim.pids:
            kwargs["pids_limit"] = lim.pids
        kwargs.update(self.run_kwargs)
        with self._lock:
            self._container = self._client.containers.run(self.image, **kwargs)

    def _mounts(self, mount_cls: Any, labels: dict[str, str]) -> list[Any]:
        mounts = [mount_cls("/workspace", None, type="volume", labels=labels)]
        if _daemon_is_local(self._client):
            self._host_dir = host_dirs_root() / self.sandbox_id
            self._host_dir.mkdir(parents=True, mode=0o755)
            tmp = self._host_dir / ".owner.tmp"  # for the reaper; atomic, so it never reads a half-written token
            tmp.write_text(owner_token())
            tmp.rename(self._host_dir / ".owner")
            mounts.append(mount_cls(HOST_SOCKET_DIR, str(self._host_dir), type="bind", read_only=True))
            agents = agents_cache_dir()
            if agents.is_dir():
                mounts.append(mount_cls(SANDBOX_AGENTS_DIR, str(agents), type="bind", read_only=True))
        return mounts

    async def _create(self) -> None:
        # docker-py blocks in a worker thread that a cancellation cannot stop: wait for it, so that close() sees the
        # container it made (recorded on self) instead of racing it and leaving it behind
        await finish_then_raise(_call(self._create_sync))

    async def expose_host_port(self, port: int, host: str = "127.0.0.1") -> str:
        """Make the host's ``host:port`` reachable inside the container at ``127.0.0.1:port`` (a unix socket in the
        container's bind-mounted host directory plus a forwarder inside; see the module docstring).

        :return: ``"127.0.0.1:PORT"``.
        :raises SandboxInfraError: the daemon is remote (no shared filesystem) or the forwarder did not start.
        """
        from vime_core.sandbox.forward import UnixToTcpForwarder, socket_name, start_sandbox_forwarder

        self._check_usable()
        key = (host, int(port))
        if key in self._forwards:
            return self._forwards[key][1]
        if self._host_dir is None:
            raise SandboxInfraError(
                f"docker sandbox {self.sandbox_id}: expose_host_port needs a daemon on this machine (unix socket); "
                f"{self.base_url!r} is remote"
            )
        if any(p == int(port) for _, p in self._forwards):
            raise SandboxInfraError(f"docker sandbox {self.sandbox_id}: port {port} is already forwarded elsewhere")
        try:
            fwd = UnixToTcpForwarder(self._host_dir / socket_name(port), host, int(port))
        except OSError as e:
            raise SandboxInfraError(f"docker sandbox {self.sandbox_id}: cannot create the forward socket: {e}") from e
        addr = f"127.0.0.1:{int(port)}"
        self._forwards[key] = (fwd, addr)
        await start_sandbox_forwarder(self, int(port), f"{HOST_SOCKET_DIR}/{socket_name(port)}")
        return addr

    async def _destroy(self) -> None:
        await _call(self._destroy_sync)

    def _destroy_sync(self) -> None:
        import docker

        for fwd, _ in self._forwards.values():
            fwd.close()
        self._forwards.clear()
        if self._host_dir is not None:
            shutil.rmtree(self._host_dir, ignore_errors=True)
        client = self._client
        if client is None:
            return
        with self._lock:
            try:
                client.api.remove_container(self.sandbox_id, force=True, v=True)
            except docker.errors.NotFound:
                pass
            except docker.errors.APIError as e:
                if "already in progress" not in str(e) and e.status_code != 409:
                    raise
            # AutoRemove deletes the anonymous volume too; this catches the rest (e.g. removal raced)
            for _ in range(50):
                vols = client.volumes.list(filters={"label": f"{LABEL}={self.sandbox_id}"})
                if not vols:
                    break
                for v in vols:
                    with contextlib.suppress(docker.errors.NotFound, docker.errors.APIError):
                        v.remove(force=True)
                time.sleep(0.05)

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
        import docker
        from docker.utils.socket import frames_iter

        api = self._client.api
        pid_file = f"/tmp/.vime/exec-{uuid.uuid4().hex[:12]}.pid"
        cmd = wrap_argv(argv, timeout, pid_file)
        try:
            exec_id = (
                await _call(
                    api.exec_create,
                    self._container.id,
                    cmd,
                    stdin=stdin is not None,
                    environment=env or None,
                    workdir=cwd,
                    user=user or "",
                )
            )["Id"]
            sock = await _call(api.exec_start, exec_id, socket=True)
        except docker.errors.APIError as e:
            left = self.remaining_s()
            if left is not None and left <= 1.0:
                raise SandboxExpiredError(f"docker sandbox {self.sandbox_id} reached its wall-time limit") from e
            raise SandboxInfraError(f"docker sandbox {self.sandbox_id}: exec failed: {e}") from e
        raw_sock = getattr(sock, "_sock", sock)
        out, err = _Sink(max_output_bytes), _Sink(max_output_bytes)

        def pump() -> None:
            if stdin is not None:
                with contextlib.suppress(OSError):
                    raw_sock.sendall(stdin)
                with contextlib.suppress(OSError):
                    raw_sock.shutdown(socket.SHUT_WR)
            with contextlib.suppress(OSError, ValueError):
                for stream, chunk in frames_iter(sock, tty=False):
                    (out if stream == 1 else err).add(chunk)

        def close_sock() -> None:
            with contextlib.suppress(OSError):
                raw_sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()

        t0 = time.monotonic()
        fut = _in_thread(pump)
        try:
            # the in-container `timeout` ends the command; the host deadline only guards against a stuck stream
            await wait_for(asyncio.shield(fut), timeout + 10.0)
        except asyncio.TimeoutError:
            await _call(self._kill_exec, pid_file)
            close_sock()
            await fut
        except asyncio.CancelledError:
            close_sock()
            await asyncio.shield(_call(self._kill_exec, pid_file))
            raise
        finally:
            close_sock()
        elapsed = time.monotonic() - t0
        code = None
        for _ in range(100):
            info = await _call(api.exec_inspect, exec_id)
            if not info.get("Running") and info.get("ExitCode") is not None:
                code = int(info["ExitCode"])
                break
            await asyncio.sleep(0.02)
        if code is None:  # still running after the host deadline
            await _call(self._kill_exec, pid_file)
            code = TIMEOUT_EXIT_CODE
        timed_out = code == TIMEOUT_EXIT_CODE and elapsed >= timeout * 0.95
        return RawExecResult(
            code, bytes(out.buf), bytes(err.buf), timed_out, out.total > out.limit, err.total > err.limit
        )

    def _kill_exec(self, pid_file: str) -> None:
        with contextlib.suppress(Exception):
            self._container.exec_run(["/bin/sh", "-c", f"kill -9 -$(cat {pid_file}) 2>/dev/null; true"])

    # -- reaper --------------------------------------------------------------------------------------------------
    @classmethod
    def cleanup(cls, *, everything: bool = False, base_url: str | None = None) -> CleanupReport:
        """Remove vime-labelled containers and volumes whose owner process is gone (all with ``everything``).

        :raises docker.errors.DockerException: the daemon is unreachable.
        """
        import docker

        report = CleanupReport(cls.NAME)
        client = docker_client(base_url)
        live_ids = set()
        for c in client.containers.list(all=True, filters={"label": LABEL}):
            sid = c.labels.get(LABEL, "?")
            report.found.append(f"container {sid}")
            if not everything and owner_alive(c.labels.get(OWNER_LABEL, "")):
                live_ids.add(sid)
                continue
            try:
                c.remove(force=True, v=True)
                report.removed.append(f"container {sid}")
            except docker.errors.NotFound:
                report.removed.append(f"container {sid}")
            except docker.errors.APIError as e:
                if e.status_code == 409:  # removal already in progress (AutoRemove)
                    report.removed.append(f"container {sid}")
                else:
                    report.errors.append(f"container {sid}: {e}")
        root = host_dirs_root()
        if root.is_dir() and _daemon_is_local(client):  # host-port directories of containers that are gone
            for d in root.iterdir():
                if not d.name.startswith("vime-") or d.name in live_ids:
                    continue
                try:
                    token = (d / ".owner").read_text()
                except OSError:  # no owner file: being created right now, or left by a crash during creation
                    token = ""
                if token:
                    dead = not owner_alive(token)
                else:
                    try:
                        dead = time.time() - d.stat().st_mtime > 60
                    except OSError:  # removed meanwhile
                        continue
                if everything or dead:
                    shutil.rmtree(d, ignore_errors=True)
                    report.removed.append(f"host dir {d.name}")
        for v in client.volumes.list(filters={"label": LABEL}):
            sid = (v.attrs.get("Labels") or {}).get(LABEL, "?")
            if sid in live_ids:
                continue
            report.found.append(f"volume {sid}")
            try:
                v.remove(force=True)
                report.removed.append(f"volume {sid}")
            except docker.errors.NotFound:
                pass
            except docker.errors.APIError as e:
                report.errors.append(f"volume {sid}: {e}")
        return report


def leftover_counts(base_url: str | None = None, ids: set[str] | None = None) -> dict[str, int]:
    """Containers and volumes carrying the vime label on the daemon (running or not), and host-port directories.

    :param ids: count only those of these sandbox ids.
    """
    client = docker_client(base_url)
    root = host_dirs_root()

    def ours(sid: str | None) -> bool:
        return sid is not None and (ids is None or sid in ids)

    containers = client.containers.list(all=True, filters={"label": LABEL})
    volumes = client.volumes.list(filters={"label": LABEL})
    return {
        "containers": sum(ours(c.labels.get(LABEL)) for c in containers),
        "volumes": sum(ours((v.attrs.get("Labels") or {}).get(LABEL)) for v in volumes),
        "host_dirs": sum(1 for d in root.iterdir() if d.name.startswith("vime-") and ours(d.name))
        if root.is_dir()
        else 0,
    }
