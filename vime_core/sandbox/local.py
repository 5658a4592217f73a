"""The ``local`` sandbox backend (built in, the embedded default): subprocesses in a fresh directory.

:class:`LocalSandbox` runs in one of two modes chosen per host (:func:`host_mode`): ``namespaces`` (root with
util-linux: pid, mount and network namespaces, read-only mounts, dropped capabilities, a cgroup per sandbox) or
``process-group`` (new sessions with rlimits, no isolation). State lives under ``VIME_SANDBOX_ROOT``, one directory
per sandbox. The modes and the state on disk: docs/sandboxes.md, "The local backend".
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import pwd
import resource
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vime_core.sandbox.base import (
    TIMEOUT_EXIT_CODE,
    CleanupReport,
    RawExecResult,
    Sandbox,
    SandboxExpiredError,
    SandboxInfraError,
    SandboxLimits,
    owner_alive,
    owner_token,
    process_start_time,
    processes_with_env,
)
from vime_core.sandbox.cancel import wait_for
from vime_core.sandbox.forward import UnixToTcpForwarder, socket_name, start_sandbox_forwarder
from vime_core.sandbox.pid1 import REAPER_SOURCE

ENV_ID = "VIME_SANDBOX_ID"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# capabilities removed from sandboxed commands in namespaces mode (remount, module load, raw devices, ptrace, ...)
DROPPED_CAPS = (
    "sys_admin",
    "sys_module",
    "sys_rawio",
    "sys_ptrace",
    "sys_boot",
    "net_admin",
    "mknod",
    "sys_time",
    "syslog",
    "mac_admin",
    "mac_override",
    "sys_pacct",
    "audit_control",
    "bpf",
    "perfmon",
)
_CGROUP_CONTROLLERS = ("memory", "pids", "cpu")

_libc = ctypes.CDLL(None, use_errno=True)


def _die_with_parent() -> None:
    _libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


# The init of a namespaced sandbox: pid 1 of its pid namespace. Sets up loopback and the read-only mounts, says
# "ready", then reaps orphans until the wall-time limit or SIGTERM; when it exits the kernel kills the namespace.
_INIT = (
    REAPER_SOURCE
    + r"""
import ctypes, fcntl, json, os, signal, socket, struct, sys, time
cfg = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
def mount(src, tgt, fs, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    if libc.mount(enc(src), enc(tgt), enc(fs), ctypes.c_ulong(flags), enc(data)) != 0:
        e = ctypes.get_errno()
        raise OSError(e, "mount %s: %s" % (tgt, os.strerror(e)))
try:
    if cfg["lo"]:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        flags = struct.unpack("16sH", fcntl.ioctl(s, 0x8913, struct.pack("16sH", b"lo", 0)))[1]
        fcntl.ioctl(s, 0x8914, struct.pack("16sH", b"lo", flags | 1))
    if cfg["fs"]:
        RDONLY, NOSUID, NODEV, NOEXEC, REMOUNT, BIND, REC, PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
        OPT = {"nosuid": NOSUID, "nodev": NODEV, "noexec": NOEXEC, "noatime": 1024, "nodiratime": 2048,
               "relatime": 1 << 21}
        mount(None, "/", None, REC | PRIVATE)
        mount(cfg["workspace"], cfg["workspace"], None, BIND)
        for p in cfg.get("expose_tmp", []):  # host dirs under /tmp that stay visible (read-only, see below)
            t = cfg["tmp"] + p[len("/tmp"):]
            os.makedirs(t, exist_ok=True)
            mount(p, t, None, BIND | REC)
        mount(cfg["tmp"], "/tmp", None, BIND | REC)
        mount("tmpfs", "/dev/shm", "tmpfs", NOSUID | NODEV, "size=%d,mode=1777" % cfg["shm_bytes"])
        keep = {cfg["workspace"], "/tmp", "/dev/shm", "/dev/pts", "/dev/mqueue"}
        for line in open("/proc/self/mountinfo").read().splitlines():
            f = line.split()
            mp = f[4].encode().decode("unicode_escape")
            if mp in keep or mp == "/proc" or mp.startswith("/proc/"):
                continue
            flags = REMOUNT | BIND | RDONLY
            for o in f[5].split(","):
                flags |= OPT.get(o, 0)
            try:
                mount(None, mp, None, flags)
            except OSError as e:
                if mp == "/":
                    raise
                sys.stderr.write("vime init: cannot make %s read-only: %s\n" % (mp, e))
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    os.close(1)
except Exception as e:
    sys.stderr.write("vime init: %s\n" % e)
    sys.exit(1)
vime_reap(None if cfg["wall_time_s"] is None else time.monotonic() + cfg["wall_time_s"])
sys.exit(0)
"""
)


# ---------------------------------------------------------------------------------------------------------------
# Host detection


def sandbox_root() -> Path:
    """Directory holding one sub-directory per local sandbox (``VIME_SANDBOX_ROOT`` overrides)."""
    env = os.environ.get("VIME_SANDBOX_ROOT")
    if env:
        return Path(env)
    base = Path("/var/tmp") if os.access("/var/tmp", os.W_OK) else Path(tempfile.gettempdir())
    return base / f"vime-sandboxes-{os.getuid()}"


_MODE: dict[str, Any] = {}


def host_mode() -> dict[str, Any]:
    """What this host allows, detected once: ``{"mode": "namespaces"|"process-group", "cgroup": "v1"|"v2"|None,
    "reason": str}``. ``VIME_SANDBOX_LOCAL_MODE=process-group`` forces the fallback."""
    if _MODE:
        return _MODE
    tools = {
        t: shutil.which(t) or next((p for p in (f"/usr/bin/{t}", f"/usr/sbin/{t}") if os.path.exists(p)), None)
        for t in ("unshare", "nsenter", "setpriv")
    }
    forced = os.environ.get("VIME_SANDBOX_LOCAL_MODE")
    mode, reason = "process-group", ""
    if forced == "process-group":
        reason = "forced by VIME_SANDBOX_LOCAL_MODE"
    elif os.geteuid() != 0:
        reason = "not root: no namespaces (use the docker or localvm backend for isolation)"
    elif not all(tools.values()):
        reason = f"missing util-linux tools: {[t for t, p in tools.items() if not p]}"
    else:
        probe = subprocess.run(
            [tools["unshare"], "--pid", "--fork", "--mount-proc", "--net", "--", "true"],
            capture_output=True,
            timeout=30,
        )
        if probe.returncode == 0:
            mode = "namespaces"
        else:
            reason = f"unshare failed: {probe.stderr.decode(errors='replace').strip()}"
    cgroup = None
    if mode == "namespaces":
        if os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
            ctl = Path("/sys/fs/cgroup/cgroup.controllers").read_text().split()
            if all(c in ctl for c in _CGROUP_CONTROLLERS) and os.access("/sys/fs/cgroup", os.W_OK):
                cgroup = "v2"
        elif all(os.access(f"/sys/fs/cgroup/{c}", os.W_OK) for c in _CGROUP_CONTROLLERS):
            cgroup = "v1"
    _MODE.update(mode=mode, cgroup=cgroup, reason=reason, tools=tools)
    return _MODE


def host_capabilities() -> frozenset[str]:
    """The contract capabilities the local backend has on this host."""
    m = host_mode()
    caps = {"detached", "reaper", "wall_time", "host_port"}
    if m["mode"] == "namespaces":
        caps |= {"network_isolation", "filesystem_isolation", "user"}
        if m["cgroup"]:
            caps.add("resource_limits")
    return frozenset(caps)


def _cgroup_dirs(sandbox_id: str, kind: str | None) -> list[Path]:
    if kind == "v1":
        return [Path(f"/sys/fs/cgroup/{c}/vime/{sandbox_id}") for c in _CGROUP_CONTROLLERS]
    if kind == "v2":
        return [Path(f"/sys/fs/cgroup/vime/{sandbox_id}")]
    return []


def _pids_with_env(sandbox_ids: set[str]) -> dict[int, str]:
    """Processes (pid → sandbox id) whose environment has ``VIME_SANDBOX_ID`` in ``sandbox_ids``."""
    return {pid: i for pid, i in processes_with_env(ENV_ID).items() if i in sandbox_ids}


def _cgroup_names() -> dict[str, str]:
    """Local-sandbox cgroups on this host: name → ``"v1"``/``"v2"`` (v1: found under any controller)."""
    found: dict[str, str] = {}
    bases = [(Path(f"/sys/fs/cgroup/{c}/vime"), "v1") for c in _CGROUP_CONTROLLERS]
    for base, kind in [*bases, (Path("/sys/fs/cgroup/vime"), "v2")]:
        with contextlib.suppress(OSError):
            for cg in base.iterdir():
                if cg.name.startswith("vime-local-") and cg.is_dir():
                    found[cg.name] = kind
    return found


def leftover_counts(prefix: str = "vime-local-", ids: set[str] | None = None) -> dict[str, int]:
    """Count local-sandbox leftovers on this host: processes (by environment), sandbox directories, cgroups.

    :param prefix: sandbox-id prefix to count.
    :param ids: count only these sandbox ids (``prefix`` is then ignored).
    """

    def ours(name: str) -> bool:
        return name in ids if ids is not None else name.startswith(prefix)

    root = sandbox_root()
    dirs = [p for p in root.glob("vime-local-*") if p.is_dir() and ours(p.name)] if root.exists() else []
    needle = ENV_ID.encode() + b"="
    procs = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/environ", "rb") as f:
                    env = f.read()
            except OSError:
                continue
            procs += any(
                v.startswith(needle) and ours(v[len(needle) :].decode(errors="replace")) for v in env.split(b"\0")
            )
    cgroups = 0
    for c in _CGROUP_CONTROLLERS:
        with contextlib.suppress(OSError):
            cgroups += sum(1 for p in Path(f"/sys/fs/cgroup/{c}/vime").iterdir() if ours(p.name))
    with contextlib.suppress(OSError):
        cgroups += sum(1 for p in Path("/sys/fs/cgroup/vime").iterdir() if ours(p.name))
    return {"processes": procs, "directories": len(dirs), "cgroups": cgroups}


def _kill_pid_if(pid: int | None, start: str | None) -> None:
    if pid and start and process_start_time(pid) == start:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _teardown_state(sandbox_id: str, directory: Path, meta: dict[str, Any], wait_s: float = 5.0) -> None:
    """Kill every process of a sandbox and remove its cgroups and directory (synchronous, idempotent)."""
    _kill_pid_if(meta.get("holder_pid"), meta.get("holder_start"))
    _kill_pid_if(meta.get("init_pid"), meta.get("init_start"))
    for pgid in meta.get("pgids", []):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
    cgroups = [Path(p) for p in meta.get("cgroups", [])]
    t_end = time.monotonic() + wait_s
    while True:
        pids = set(_pids_with_env({sandbox_id}))
        for cg in cgroups:
            with contextlib.suppress(OSError):
                pids |= {int(x) for x in (cg / "cgroup.procs").read_text().split()}
        pids.discard(os.getpid())
        if not pids or time.monotonic() > t_end:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)
    for cg in cgroups:
        for _ in range(100):
            try:
                cg.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.02)
    if directory.exists():
        shutil.rmtree(directory, ignore_errors=True)


def _read_meta(directory: Path) -> dict[str, Any] | None:
    try:
        return json.loads((directory / "meta.json").read_text())
    except (OSError, ValueError):
        return None


class _Sink:
    """Keeps the first ``limit`` bytes of a stream and counts the rest."""

    def __init__(self, limit: int) -> None:
        self.limit, self.buf, self.total = limit, bytearray(), 0

    async def drain(self, stream: asyncio.StreamReader) -> None:
        while chunk := await stream.read(65536):
            room = self.limit - len(self.buf)
            if room > 0:
                self.buf += chunk[:room]
            self.total += len(chunk)

    @property
    def truncated(self) -> bool:
        return self.total > self.limit


# ---------------------------------------------------------------------------------------------------------------


def _python_dirs_under_tmp() -> list[str]:
    """This interpreter's environment and vime's source tree when they live under ``/tmp`` (e.g. a checkout and its
    ``.venv`` there): the sandbox gets a private ``/tmp``, so these are bound back in, read-only, so that commands in
    the sandbox can run ``sys.executable`` with the same packages (as they can anywhere else on the host)."""
    import sys

    out = []
    for d in {os.path.realpath(sys.prefix), os.path.realpath(Path(__file__).resolve().parents[2])}:
        if (d + "/").startswith("/tmp/") and os.path.isdir(d):
            out.append(d)
    return [d for d in sorted(out) if not any(d != o and d.startswith(o + "/") for o in out)]


class LocalSandbox(Sandbox):
    """Subprocesses in a fresh directory on this machine (see the module docstring for the two modes).

    :param limits: resource limits; ``disk_bytes`` is enforced as the largest file size (``RLIMIT_FSIZE``) and as
        the size of ``/dev/shm``.
    :param network: share the host's network (namespaces mode has none by default; process-group mode always
        shares it).
    :param env: environment of every command (over a clean base: ``PATH``, ``HOME``, ``LANG``, ``TMPDIR``).
    :param default_timeout_s: default ``exec`` timeout in seconds.
    """

    NAME = "local"

    def __init__(
        self,
        *,
        limits: SandboxLimits | None = None,
        network: bool = False,
        env: dict[str, str] | None = None,
        default_timeout_s: float = 300.0,
    ) -> None:
        super().__init__(limits=limits, network=network, env=env, default_timeout_s=default_timeout_s)
        self.capabilities = host_capabilities()  # type: ignore[misc] - per host, not per class
        self._host = host_mode()
        self.directory = sandbox_root() / self.sandbox_id
        self.workspace = str(self.directory / "workspace")
        if self._host["mode"] != "namespaces":  # /tmp is the host's: keep detached-command files in the sandbox
            self.control_dir = str(self.directory / "tmp" / ".vime")  # type: ignore[misc]
        self._meta: dict[str, Any] = {}
        self._holder: asyncio.subprocess.Process | None = None
        self._procs: set[asyncio.subprocess.Process] = set()
        self._forwards: dict[tuple[str, int], tuple[Any, str]] = {}

    @property
    def mode(self) -> str:
        return self._host["mode"]

    # -- lifecycle -----------------------------------------------------------------------------------------------
    def _write_meta(self) -> None:
        tmp = self.directory / "meta.json.tmp"
        tmp.write_text(json.dumps(self._meta))
        tmp.replace(self.directory / "meta.json")

    def _cgroup_join(self) -> None:
        """In a forked child: join the sandbox's cgroups and die with the parent."""
        _die_with_parent()
        pid = str(os.getpid()).encode()
        for cg in self._meta.get("cgroups", []):
            fd = os.open(os.path.join(cg, "cgroup.procs"), os.O_WRONLY)
            try:
                os.write(fd, pid)
            finally:
                os.close(fd)

    def _make_cgroups(self) -> list[str]:
        """Create this sandbox's cgroups and set their limits."""
        kind = self._host["cgroup"]
        dirs = _cgroup_dirs(self.sandbox_id, kind)
        lim = self.limits
        if kind == "v2":
            parent = Path("/sys/fs/cgroup/vime")
            parent.mkdir(exist_ok=True)
            (parent / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in _CGROUP_CONTROLLERS))
        for d in dirs:
            d.mkdir(parents=True, exist_ok=True)
        if kind == "v1":
            mem, pids, cpu = dirs
            if lim.memory_bytes:
                (mem / "memory.limit_in_bytes").write_text(str(lim.memory_bytes))
            if lim.pids:
                (pids / "pids.max").write_text(str(lim.pids))
            if lim.cpus:
                (cpu / "cpu.cfs_period_us").write_text("100000")
                (cpu / "cpu.cfs_quota_us").write_text(str(max(1000, int(lim.cpus * 100000))))
        elif kind == "v2":
            (d,) = dirs
            if lim.memory_bytes:
                (d / "memory.max").write_text(str(lim.memory_bytes))
                with contextlib.suppress(OSError):
                    (d / "memory.swap.max").write_text("0")
            if lim.pids:
                (d / "pids.max").write_text(str(lim.pids))
            if lim.cpus:
                (d / "cpu.max").write_text(f"{max(1000, int(lim.cpus * 100000))} 100000")
        return [str(d) for d in dirs]

    async def _create(self) -> None:
        self.directory.mkdir(parents=True, mode=0o711)
        (self.directory / "workspace").mkdir(mode=0o755)
        (self.directory / "tmp").mkdir()
        os.chmod(self.directory / "tmp", 0o1777)
        self._meta = {
            "id": self.sandbox_id,
            "owner": owner_token(),
            "mode": self.mode,
            "pgids": [],
            "created": time.time(),
        }
        self._write_meta()
        if self.mode != "namespaces":
            return
        self._meta["cgroups"] = self._make_cgroups()
        self._write_meta()
        cfg = {
            "lo": not self.network,
            "fs": True,
            "workspace": self.workspace,
            "tmp": str(self.directory / "tmp"),
            "shm_bytes": self.limits.disk_bytes or 64 << 20,
            "wall_time_s": self.limits.wall_time_s,
            "expose_tmp": _python_dirs_under_tmp(),
        }
        unshare = self._host["tools"]["unshare"]
        argv = [unshare, "--pid", "--fork", "--kill-child=SIGKILL", "--mount-proc"]
        if not self.network:
            argv.append("--net")
        import sys

        (self.directory / "init.py").write_text(_INIT)
        argv += ["--", sys.executable, "-I", "-S", str(self.directory / "init.py"), json.dumps(cfg)]
        self._holder = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={ENV_ID: self.sandbox_id, "PATH": DEFAULT_PATH},
            start_new_session=True,
            preexec_fn=self._cgroup_join,
        )
        self._meta.update(holder_pid=self._holder.pid, holder_start=process_start_time(self._holder.pid))
        self._write_meta()
        assert self._holder.stdout is not None and self._holder.stderr is not None
        timed_out = False
        try:
            line = await wait_for(self._holder.stdout.readline(), timeout=30)
        except asyncio.TimeoutError:
            line, timed_out = b"", True
        if line.strip() != b"ready":
            err = b""
            with contextlib.suppress(asyncio.TimeoutError):
                err = await wait_for(self._holder.stderr.read(4096), timeout=1)
            with contextlib.suppress(asyncio.TimeoutError):
                await wait_for(self._holder.wait(), timeout=1)
            how = "no 'ready' within 30 s" if timed_out else f"init exited with code {self._holder.returncode}"
            raise SandboxInfraError(
                f"local sandbox init did not start ({how}): {err.decode(errors='replace').strip()}"
            )
        init_pid = self._find_child(self._holder.pid)
        self._meta.update(init_pid=init_pid, init_start=process_start_time(init_pid))
        self._write_meta()

    @staticmethod
    def _find_child(pid: int) -> int:
        try:
            kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            if kids:
                return int(kids[0])
        except OSError:
            pass
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                try:
                    stat = Path(f"/proc/{entry.name}/stat").read_text()
                except OSError:
                    continue
                if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                    return int(entry.name)
        raise SandboxInfraError(f"local sandbox: the init process of holder {pid} is gone")

    async def expose_host_port(self, port: int, host: str = "127.0.0.1") -> str:
        """Make ``host:port`` reachable inside the sandbox at ``127.0.0.1:port``.

        Namespaces mode without network: a unix socket in the sandbox's private ``/tmp`` (``/tmp/.vime-host/``),
        served on the host by a :class:`~vime_core.sandbox.forward.UnixToTcpForwarder`, and a small Python
        forwarder inside listening on the sandbox's loopback; no interface is added. With ``network=True`` or in
        process-group mode the sandbox shares the host's network and ``host:port`` is returned as it is.

        :return: ``"127.0.0.1:PORT"`` (or ``"HOST:PORT"`` with a shared network).
        :raises SandboxInfraError: the forward could not be set up.
        """
        self._check_usable()
        if self.network or self.mode != "namespaces":
            return f"{host}:{int(port)}"
        key = (host, int(port))
        if key in self._forwards:
            return self._forwards[key][1]
        if any(p == int(port) for _, p in self._forwards):
            raise SandboxInfraError(f"local sandbox {self.sandbox_id}: port {port} is already forwarded elsewhere")
        host_dir = self.directory / "tmp" / ".vime-host"
        host_dir.mkdir(mode=0o755, exist_ok=True)
        try:
            fwd = UnixToTcpForwarder(host_dir / socket_name(port), host, int(port))
        except OSError as e:
            raise SandboxInfraError(f"local sandbox {self.sandbox_id}: cannot create the forward socket: {e}") from e
        addr = f"127.0.0.1:{int(port)}"
        self._forwards[key] = (fwd, addr)
        await start_sandbox_forwarder(self, int(port), f"/tmp/.vime-host/{socket_name(port)}")
        return addr

    async def _destroy(self) -> None:
        for fwd, _ in self._forwards.values():
            fwd.close()
        self._forwards.clear()
        for proc in list(self._procs):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        await asyncio.to_thread(self._destroy_sync)
        if self._holder is not None:
            with contextlib.suppress(ProcessLookupError):
                self._holder.kill()
            await self._holder.wait()

    def _destroy_sync(self) -> None:
        _teardown_state(self.sandbox_id, self.directory, self._meta)

    def _alive(self) -> bool:
        pid, start = self._meta.get("init_pid"), self._meta.get("init_start")
        if pid is None:
            return True
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return False
        return state not in ("Z", "X") and process_start_time(pid) == start

    # -- exec ----------------------------------------------------------------------------------------------------
    def _child_setup(self, rlimits: list[tuple[int, int]]) -> Any:
        cgroup_join = self._cgroup_join

        def setup() -> None:
            cgroup_join()
            for which, value in rlimits:
                resource.setrlimit(which, (value, value))

        return setup

    def _rlimits(self) -> list[tuple[int, int]]:
        lim = self.limits
        out = [(resource.RLIMIT_CORE, 0)]
        if lim.disk_bytes:
            out.append((resource.RLIMIT_FSIZE, lim.disk_bytes))
        if lim.open_files:
            out.append((resource.RLIMIT_NOFILE, lim.open_files))
        if lim.memory_bytes and not self._meta.get("cgroups"):
            out.append((resource.RLIMIT_AS, lim.memory_bytes))
        return out

    def _command(self, argv: Sequence[str], cwd: str, user: str | None) -> list[str]:
        if self.mode != "namespaces":
            return list(argv)
        tools = self._host["tools"]
        cmd = [tools["nsenter"], "-t", str(self._meta["init_pid"]), "-m", "-p"]
        if not self.network:
            cmd.append("-n")
        cmd += [
            f"--wd={cwd}",
            "--",
            tools["setpriv"],
            "--no-new-privs",
            "--bounding-set=" + ",".join(f"-{c}" for c in DROPPED_CAPS),
        ]
        if user is not None:
            pw = pwd.getpwuid(int(user)) if str(user).isdigit() else pwd.getpwnam(user)
            cmd += [f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--init-groups"]
        return cmd + ["--", *argv]

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
        if not self._alive():
            left = self.remaining_s()
            if left is not None and left <= 0.5:
                raise SandboxExpiredError(f"local sandbox {self.sandbox_id} reached its wall-time limit")
            raise SandboxInfraError(f"local sandbox {self.sandbox_id}: its init process is gone")
        full_env = {
            "PATH": DEFAULT_PATH,
            "HOME": self.workspace,
            "LANG": "C.UTF-8",
            "TMPDIR": "/tmp",
            **env,
            ENV_ID: self.sandbox_id,
        }
        if self.mode != "namespaces":
            full_env["TMPDIR"] = str(self.directory / "tmp")
            if not os.path.isdir(cwd):
                return RawExecResult(1, b"", f"cannot change directory to {cwd}: no such directory\n".encode())
        try:
            proc = await asyncio.create_subprocess_exec(
                *self._command(argv, cwd, user),
                stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=full_env,
                cwd=cwd if self.mode != "namespaces" else None,
                start_new_session=True,
                preexec_fn=self._child_setup(self._rlimits()),
            )
        except FileNotFoundError as e:
            if self.mode != "namespaces":
                return RawExecResult(127, b"", f"{e}\n".encode())
            raise
        self._procs.add(proc)
        if self.mode != "namespaces":
            self._meta["pgids"].append(proc.pid)
            self._write_meta()
        out, err = _Sink(max_output_bytes), _Sink(max_output_bytes)
        assert proc.stdout is not None and proc.stderr is not None
        readers = [asyncio.ensure_future(out.drain(proc.stdout)), asyncio.ensure_future(err.drain(proc.stderr))]
        feeder = asyncio.ensure_future(self._feed(proc, stdin)) if stdin is not None else None
        timed_out = False
        try:
            try:
                await wait_for(proc.wait(), timeout)
            except asyncio.TimeoutError:
                timed_out = True
                self._killpg(proc)
                await proc.wait()
            # processes left in the command's group holding its output: give them a moment, then kill them
            _, pending = await asyncio.wait(readers, timeout=0.2)
            if pending:
                self._killpg(proc)
                _, pending = await asyncio.wait(readers, timeout=1.0)
                for t in pending:
                    t.cancel()
                transport = getattr(proc, "_transport", None)
                if transport is not None:
                    transport.close()
        except BaseException:
            self._killpg(proc)
            for t in readers:
                t.cancel()
            raise
        finally:
            if feeder is not None:
                feeder.cancel()
            self._procs.discard(proc)
        code = proc.returncode if proc.returncode is not None else TIMEOUT_EXIT_CODE
        if code < 0:
            code = 128 - code
        if not self._alive():
            left = self.remaining_s()
            if left is None or left > 0.5:
                raise SandboxInfraError(f"local sandbox {self.sandbox_id}: its init process died during the command")
            timed_out = True  # killed with the whole sandbox at its wall-time limit
        if timed_out:
            code = TIMEOUT_EXIT_CODE
        return RawExecResult(code, bytes(out.buf), bytes(err.buf), timed_out, out.truncated, err.truncated)

    @staticmethod
    def _killpg(proc: asyncio.subprocess.Process) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)

    @staticmethod
    async def _feed(proc: asyncio.subprocess.Process, data: bytes) -> None:
        assert proc.stdin is not None
        try:
            proc.stdin.write(data)
            await proc.stdin.drain()
            proc.stdin.close()
        except (BrokenPipeError, ConnectionResetError):
            pass

    # -- reaper --------------------------------------------------------------------------------------------------
    @classmethod
    def cleanup(cls, *, everything: bool = False) -> CleanupReport:
        """Remove local sandboxes (directories, processes, cgroups) whose owner process is gone.

        :param everything: also those of running processes (this one's included).
        """
        report = CleanupReport("local")
        root = sandbox_root()
        seen: set[str] = set()
        if root.exists():
            for d in sorted(root.iterdir()):
                if not d.is_dir() or not d.name.startswith("vime-local-"):
                    continue
                seen.add(d.name)
                meta = _read_meta(d)
                report.found.append(d.name)
                if meta is not None and not everything and owner_alive(meta.get("owner", "")):
                    continue
                if meta is None and not everything and time.time() - d.stat().st_mtime < 60:
                    continue  # being created right now
                try:
                    _teardown_state(d.name, d, meta or {})
                    report.removed.append(d.name)
                except Exception as e:  # noqa: BLE001
                    report.errors.append(f"{d.name}: {e}")
        # cgroups without a directory (their sandbox was removed by hand). A sandbox starting meanwhile made its
        # directory before its cgroups, so one whose directory exists now is not an orphan (the directory scan above
        # may have missed it): tearing it down would remove a live sandbox's fresh cgroups (ENOENT on its limits).
        for name, kind in _cgroup_names().items():
            if name in seen or (root / name).exists():
                continue
            report.found.append(f"cgroup {name}")
            _teardown_state(name, root / name, {"cgroups": [str(p) for p in _cgroup_dirs(name, kind)]})
            report.removed.append(f"cgroup {name}")
        return report
