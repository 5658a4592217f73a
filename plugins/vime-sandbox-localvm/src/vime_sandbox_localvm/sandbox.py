"""``LocalVMSandbox``: a QEMU virtual machine per sandbox, driven over SSH (asyncssh).

Boot: the base image (:mod:`vime_sandbox_localvm.image`) is never written; each sandbox gets a throw-away qcow2
overlay on it (so every sandbox starts clean), QEMU boots its kernel directly with KVM when ``/dev/kvm`` is usable
(else TCG software emulation, much slower), and SSH reaches the guest through a user-network port forward bound to
``127.0.0.1``. Without ``network=True`` that network is ``restrict=on``: the guest reaches nothing but the forward.
The VM's RAM and vCPUs are the memory and CPU limits, ``/workspace`` and ``/tmp`` are tmpfs of ``disk_bytes``, the
root filesystem is read-only, sshd (and so every command) runs in a cgroup with ``pids.max``, and commands run with
``no_new_privs`` and without ``CAP_SYS_ADMIN`` (they cannot remount anything). The guest powers itself off at the
wall-time limit; QEMU dies with the vime process that started it (``PR_SET_PDEATHSIG``); teardown kills QEMU and
deletes the overlay. State lives in ``VIME_SANDBOX_ROOT``/``localvm``-style directories (``meta.json``: owner,
QEMU pid) that :meth:`LocalVMSandbox.cleanup` reaps.

Attach mode (``ssh="user@host:port"``): use an already-running machine instead of booting one. Each sandbox is then a
fresh directory ``/var/tmp/vime-workspaces/<id>`` on it; teardown kills the sandbox's processes (found by their
``VIME_SANDBOX_ID`` environment variable) and removes the directory. No isolation beyond what that machine gives.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import math
import os
import shlex
import shutil
import signal
import socket
import time
import uuid
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
)
from vime_core.sandbox.cancel import finish_then_raise, wait_for
from vime_sandbox_localvm.flags import LocalVMFlags
from vime_sandbox_localvm.image import AGENTS_TAG, IMAGE_FORMAT, default_image_dir, image_format, image_ready

ENV_ID = "VIME_SANDBOX_ID"
DROPPED_CAPS = ("sys_admin", "sys_module", "sys_rawio", "sys_ptrace", "sys_boot", "net_admin", "mknod", "sys_time",
                "bpf", "perfmon", "sys_resource")
_libc = ctypes.CDLL(None, use_errno=True)


def state_root() -> Path:
    """Directory of per-VM state (overlay, console log, meta.json): ``VIME_SANDBOX_ROOT`` or /var/tmp."""
    env = os.environ.get("VIME_SANDBOX_ROOT")
    base = Path(env) if env else Path("/var/tmp") / f"vime-sandboxes-{os.getuid()}"
    return base / "localvm"


def kvm_usable() -> bool:
    """Whether ``/dev/kvm`` can be opened read-write."""
    try:
        fd = os.open("/dev/kvm", os.O_RDWR)
    except OSError:
        return False
    os.close(fd)
    return True


_KVM_PROBE: dict[str, bool] = {}


def kvm_boots(image_dir: Path, timeout_s: float = 20.0) -> bool:
    """Whether a guest kernel gets past its decompressor under KVM here (``/dev/kvm`` opening is not enough: on
    some nested hosts the guest hangs). Probed once per host boot, cached in ``image_dir/kvm-probe.json``;
    ``VIME_LOCALVM_ACCEL=kvm|tcg`` overrides."""
    forced = os.environ.get("VIME_LOCALVM_ACCEL")
    if forced in ("kvm", "tcg"):
        return forced == "kvm"
    if not kvm_usable():
        return False
    from vime_core.sandbox.base import _boot_id

    key = f"{_boot_id()}:{image_dir}"
    if key in _KVM_PROBE:
        return _KVM_PROBE[key]
    cache = image_dir / "kvm-probe.json"
    try:
        cached = json.loads(cache.read_text())
        if cached.get("boot_id") == _boot_id():
            _KVM_PROBE[key] = bool(cached["kvm"])
            return _KVM_PROBE[key]
    except (OSError, ValueError, KeyError):
        pass
    import subprocess

    argv = [shutil.which("qemu-system-x86_64") or "qemu-system-x86_64", "-machine", "q35,accel=kvm", "-cpu",
            "host,-arch-capabilities", "-m", "256", "-nodefaults", "-display", "none", "-monitor", "none",
            "-serial", "stdio", "-no-reboot", "-kernel", str(image_dir / "vmlinuz"),
            "-append", "console=ttyS0 panic=-1 earlyprintk=serial,ttyS0"]
    ok = False
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    t_end = time.monotonic() + timeout_s
    try:
        assert proc.stdout is not None
        os.set_blocking(proc.stdout.fileno(), False)
        seen = b""
        while time.monotonic() < t_end and proc.poll() is None:
            chunk = proc.stdout.read(65536) or b""
            seen += chunk
            if b"Linux version" in seen:
                ok = True
                break
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait()
    _KVM_PROBE[key] = ok
    with contextlib.suppress(OSError):
        cache.write_text(json.dumps({"boot_id": _boot_id(), "kvm": ok}))
    return ok


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    _libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class _Sink:
    def __init__(self, limit: int) -> None:
        self.limit, self.buf, self.total = limit, bytearray(), 0

    async def drain(self, stream: Any) -> None:
        while True:
            chunk = await stream.read(65536)
            if not chunk:
                return
            room = self.limit - len(self.buf)
            if room > 0:
                self.buf += chunk[:room]
            self.total += len(chunk)


class LocalVMSandbox(Sandbox):
    """A VM per sandbox (see the module docstring).

    :param image_dir: directory made by ``vime-sandbox-localvm build-image`` (default ``~/.cache/vime/localvm/
        bookworm``).
    :param limits: ``memory_bytes`` → VM RAM (at least 256 MiB), ``cpus`` → vCPUs (rounded up), ``disk_bytes`` →
        size of the ``/workspace`` and ``/tmp`` tmpfs, ``pids`` → cgroup ``pids.max`` (+8 for sshd's own).
    :param network: unrestricted user-mode network (NAT to the host's network) instead of ``restrict=on``.
    :param accel: ``"auto"`` (KVM if usable, else TCG), ``"kvm"`` or ``"tcg"``.
    :param boot_timeout_s: seconds to wait for SSH after starting QEMU (default 120 with KVM, 900 with TCG).
    :param ssh: attach to a running machine ``user@host:port`` instead of booting (``ssh_key`` logs in).
    :param ssh_key: private key file for ``ssh`` (default: the image's ``id_ed25519``).
    :param agents_dir: host directory of prepared agent CLIs shown read-only in the guest at
        :data:`~vime_core.sandbox.base.SANDBOX_AGENTS_DIR` (``/opt/vime/agents``, where docker mounts it too) through
        a 9p share (``-fsdev local,readonly=on``): nothing is copied and the image does not depend on agent versions.
        Default: :func:`~vime_core.sandbox.base.agents_cache_dir` when it exists; ``False``: no share. Needs an image
        of format ≥ 2 (``build-image`` rebuilds older ones); with an older image there is no share (agent harnesses
        then copy the CLI into the VM).
    """

    NAME = "localvm"
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
    FLAGS = LocalVMFlags
    FLAG_KWARGS = {"sandbox_localvm_image_dir": "image_dir", "sandbox_localvm_accel": "accel",
                   "sandbox_localvm_ssh": "ssh", "sandbox_localvm_ssh_key": "ssh_key"}

    def __init__(
        self,
        *,
        image_dir: str | os.PathLike[str] | None = None,
        limits: SandboxLimits | None = None,
        network: bool = False,
        env: dict[str, str] | None = None,
        default_timeout_s: float = 300.0,
        accel: str = "auto",
        boot_timeout_s: float | None = None,
        ssh: str | None = None,
        ssh_key: str | os.PathLike[str] | None = None,
        agents_dir: str | os.PathLike[str] | bool | None = None,
    ) -> None:
        super().__init__(limits=limits, network=network, env=env, default_timeout_s=default_timeout_s)
        if agents_dir is None or agents_dir is True:
            from vime_core.sandbox.base import agents_cache_dir

            agents_dir = agents_cache_dir()
        self.agents_dir = Path(agents_dir) if agents_dir else None
        self.image_dir = Path(image_dir) if image_dir else default_image_dir()
        self.accel = accel
        self.boot_timeout_s = boot_timeout_s
        self.ssh = ssh
        self.ssh_key = Path(ssh_key) if ssh_key else self.image_dir / "id_ed25519"
        self.directory = state_root() / self.sandbox_id
        self.workspace = "/workspace"  # attach mode: /var/tmp/vime-workspaces/<id> (or under /tmp), set on start
        if ssh is not None:  # an existing machine: no VM boundary, no limits of ours
            self.capabilities = frozenset({"detached"})  # type: ignore[misc]
            self.control_dir = f"{self.workspace}.ctl"  # type: ignore[misc]
        self._qemu: asyncio.subprocess.Process | None = None
        self._conn: Any = None
        self._meta: dict[str, Any] = {}
        self._wall_timer: asyncio.TimerHandle | None = None
        self.port: int | None = None
        self._forwards: dict[tuple[str, int], tuple[Any, str]] = {}  # (host, port) -> (asyncssh listener, address)

    # -- lifecycle -----------------------------------------------------------------------------------------------
    def _write_meta(self) -> None:
        tmp = self.directory / "meta.json.tmp"
        tmp.write_text(json.dumps(self._meta))
        tmp.replace(self.directory / "meta.json")

    def _accel(self) -> str:
        if self.accel == "auto":
            return "kvm" if kvm_boots(self.image_dir) else "tcg"
        return self.accel

    def _agents_share(self) -> Path | None:
        """The host directory shared at ``/opt/vime/agents``, or ``None`` (no directory, or an image too old)."""
        if self.agents_dir is None or not self.agents_dir.is_dir() or image_format(self.image_dir) < IMAGE_FORMAT:
            return None
        return self.agents_dir

    def _qemu_argv(self, port: int) -> list[str]:
        lim = self.limits
        agents = self._agents_share()
        accel = self._accel()
        mem_mb = max(256, (lim.memory_bytes or 1 << 30) >> 20)
        cpus = max(1, math.ceil(lim.cpus or 1))
        disk = lim.disk_bytes or 1 << 30
        # the host kills QEMU at the wall-time limit; the guest powers itself off later as a backstop
        wall = 0 if lim.wall_time_s is None else math.ceil(lim.wall_time_s) + 120
        pids = 0 if lim.pids is None else lim.pids + 8
        cmdline = (f"root=/dev/vda ro console=ttyS0 panic=-1 net.ifnames=0 quiet init=/usr/local/sbin/vime-init "
                   f"vime.disk={disk} vime.wall={wall} vime.pids={pids} vime.net={int(self.network)} "
                   f"vime.agents={int(agents is not None)}")
        share = []
        if agents is not None:  # 9p, read-only on the host side too; ids as on the host (security_model=none)
            if "," in str(agents):
                raise SandboxInfraError(f"agents directory {agents} has a comma in its path (QEMU -fsdev cannot take "
                                        "it); set VIME_CACHE_DIR or pass agents_dir=False")
            share = ["-fsdev", f"local,id=agents,path={agents},security_model=none,readonly=on",
                     "-device", f"virtio-9p-pci,fsdev=agents,mount_tag={AGENTS_TAG}"]
        restrict = "off" if self.network else "on"
        return [
            shutil.which("qemu-system-x86_64") or "qemu-system-x86_64",
            "-name", f"{self.sandbox_id},process={self.sandbox_id}",
            "-machine", f"q35,accel={accel}", "-cpu", "host,-arch-capabilities" if accel == "kvm" else "max",
            "-smp", str(cpus), "-m", str(mem_mb),
            "-nodefaults", "-no-user-config", "-display", "none", "-monitor", "none", "-no-reboot",
            "-serial", f"file:{self.directory / 'console.log'}",
            "-kernel", str(self.image_dir / "vmlinuz"), "-initrd", str(self.image_dir / "initrd.img"),
            "-append", cmdline,
            "-drive", f"file={self.directory / 'overlay.qcow2'},if=virtio,format=qcow2,cache=unsafe",
            "-netdev", f"user,id=n0,restrict={restrict},hostfwd=tcp:127.0.0.1:{port}-:22",
            "-device", "virtio-net-pci,netdev=n0", "-device", "virtio-rng-pci",
            *share,
        ]

    async def _create(self) -> None:
        if self.ssh is not None:
            await self._attach()
            return
        if not image_ready(self.image_dir):
            raise SandboxInfraError(
                f"no VM image in {self.image_dir}; build it with `vime-sandbox-localvm build-image`"
            )
        self.directory.mkdir(parents=True, mode=0o700)
        self._meta = {"id": self.sandbox_id, "owner": owner_token(), "created": time.time()}
        self._write_meta()
        proc = await asyncio.create_subprocess_exec(
            "qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", str(self.image_dir / "base.qcow2"),
            str(self.directory / "overlay.qcow2"), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )
        out, _ = await finish_then_raise(proc.communicate())  # not cancelled halfway: it writes into self.directory
        if proc.returncode != 0:
            raise SandboxInfraError(f"qemu-img create failed: {out.decode(errors='replace')}")
        accel = self._accel()
        boot_timeout = self.boot_timeout_s or (120.0 if accel == "kvm" else 900.0)
        for attempt in range(3):
            self.port = _free_port()
            self._qemu = await asyncio.create_subprocess_exec(
                *self._qemu_argv(self.port), stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE, env={**os.environ, ENV_ID: self.sandbox_id},
                start_new_session=True, preexec_fn=_die_with_parent,
            )
            self._meta.update(qemu_pid=self._qemu.pid, qemu_start=process_start_time(self._qemu.pid), port=self.port)
            self._write_meta()
            try:
                await self._connect(boot_timeout)
                if self.limits.wall_time_s is not None:
                    self._wall_timer = asyncio.get_running_loop().call_later(self.limits.wall_time_s, self._expire)
                return
            except _PortTaken:
                if attempt == 2:
                    raise SandboxInfraError("could not bind a host port for the VM's SSH forward") from None

    def _expire(self) -> None:
        """At the wall-time limit: kill the VM (everything in it dies with it)."""
        if self._qemu is not None and self._qemu.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._qemu.kill()

    async def _connect(self, boot_timeout: float) -> None:
        import asyncssh

        assert self._qemu is not None and self.port is not None
        t_end = time.monotonic() + boot_timeout
        last: Exception | None = None
        while time.monotonic() < t_end:
            if self._qemu.returncode is not None:
                err = b""
                if self._qemu.stderr is not None:
                    err = await self._qemu.stderr.read()
                if b"hostfwd" in err or b"host forwarding" in err:
                    raise _PortTaken()
                raise SandboxInfraError(f"QEMU exited ({self._qemu.returncode}): {err.decode(errors='replace')[-800:]}"
                                        f"\nconsole: {self._console_tail()}")
            try:
                self._conn = await asyncssh.connect(
                    "127.0.0.1", port=self.port, username="root", client_keys=[str(self.ssh_key)],
                    known_hosts=None, connect_timeout=5, keepalive_interval=30,
                )
                return
            except (OSError, asyncssh.Error, asyncio.TimeoutError) as e:
                last = e
                await asyncio.sleep(0.2)
        raise SandboxInfraError(f"VM did not answer on SSH within {boot_timeout:.0f} s ({last}); console: "
                                f"{self._console_tail()}")

    def _console_tail(self, n: int = 1500) -> str:
        try:
            return (self.directory / "console.log").read_text(errors="replace")[-n:]
        except OSError:
            return "(no console log)"

    async def _attach(self) -> None:
        import asyncssh

        assert self.ssh is not None
        user, _, hostport = self.ssh.rpartition("@")
        host, _, port = hostport.partition(":")
        self._conn = await asyncssh.connect(host, port=int(port or 22), username=user or "root",
                                            client_keys=[str(self.ssh_key)], known_hosts=None, connect_timeout=30)
        sid = shlex.quote(self.sandbox_id)
        r = await self._conn.run(f"for d in /var/tmp /tmp; do if mkdir -p $d/vime-workspaces/{sid} "
                                 f"$d/vime-workspaces/{sid}.ctl 2>/dev/null; then echo $d; exit 0; fi; done; exit 1")
        if r.exit_status != 0:
            raise SandboxInfraError(f"cannot create a workspace under /var/tmp or /tmp on {self.ssh}: {r.stderr}")
        self.workspace = f"{str(r.stdout).strip()}/vime-workspaces/{self.sandbox_id}"
        self.control_dir = f"{self.workspace}.ctl"  # type: ignore[misc]

    async def expose_host_port(self, port: int, host: str = "127.0.0.1") -> str:
        """Make the host's ``host:port`` reachable inside the VM at ``127.0.0.1:port``: SSH remote port forwarding
        (asyncssh ``forward_remote_port``) over the sandbox's own connection; the guest's user network stays
        restricted. Ends with the connection at teardown.

        :return: ``"127.0.0.1:PORT"``.
        :raises SandboxInfraError: the guest's sshd refused the forward (port taken in the guest, forwarding off).
        """
        import asyncssh

        self._check_usable()
        forwards = self._forwards
        key = (host, int(port))
        if key in forwards:
            return forwards[key][1]
        try:
            listener = await self._conn.forward_remote_port("127.0.0.1", int(port), host, int(port))
        except (asyncssh.Error, OSError) as e:
            raise SandboxInfraError(f"localvm sandbox {self.sandbox_id}: remote forward of {port} failed: {e}") from e
        forwards[key] = (listener, f"127.0.0.1:{int(port)}")
        return forwards[key][1]

    async def _destroy(self) -> None:
        for listener, _ in self._forwards.values():
            listener.close()
        self._forwards.clear()
        if self.ssh is not None:
            await self._detach()
            return
        if self._wall_timer is not None:
            self._wall_timer.cancel()
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._qemu is not None and self._qemu.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._qemu.kill()
            await self._qemu.wait()
        await asyncio.to_thread(self._destroy_sync)

    def _destroy_sync(self) -> None:
        if self.ssh is not None:
            return
        _kill_vm(self._meta)
        if self.directory.exists():
            shutil.rmtree(self.directory, ignore_errors=True)

    async def _detach(self) -> None:
        if self._conn is None:
            return
        sid = shlex.quote(self.sandbox_id)
        script = (f"for e in /proc/[0-9]*/environ; do if grep -qz '^{ENV_ID}='{sid}'$' $e 2>/dev/null; then "
                  f"p=${{e%/environ}}; kill -9 ${{p#/proc/}} 2>/dev/null; fi; done")
        if self.workspace.endswith(f"/vime-workspaces/{self.sandbox_id}"):  # only what _attach created
            script += f"; rm -rf {shlex.quote(self.workspace)} {shlex.quote(self.control_dir)}"
        with contextlib.suppress(Exception):
            await wait_for(self._conn.run(script), 60)
        self._conn.close()
        self._conn = None

    # -- exec ----------------------------------------------------------------------------------------------------
    def _command(self, argv: list[str], env: dict[str, str], cwd: str, user: str | None, pid_file: str,
                 timeout: float) -> str:
        """One script for the login shell: few processes, since every exec is costly in an emulated guest. Same
        semantics as :data:`vime_core.sandbox.base.EXEC_WRAPPER` (own process group, timeout, leftovers killed)."""
        full_env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": self.workspace,
                    "LANG": "C.UTF-8", "TMPDIR": "/tmp", **env, ENV_ID: self.sandbox_id}
        prefix = ""
        if self.ssh is None:
            prefix = "setpriv --no-new-privs --bounding-set=" + ",".join(f"-{c}" for c in DROPPED_CAPS) + " "
            if user is not None:
                prefix += f"{shlex.quote('--reuid=' + str(user))} --regid={_gid_expr(user)} --init-groups "
            prefix += "-- "
        f = shlex.quote(pid_file)
        return (
            f"cd -- {shlex.quote(cwd)} || exit 1; unset SSH_CLIENT SSH_CONNECTION SSH_TTY MAIL USER LOGNAME SHELL "
            f"MOTD_SHOWN OLDPWD; export {' '.join(shlex.quote(f'{k}={v}') for k, v in full_env.items())}; "
            f"exec 3<&0; mkdir -p -m 1777 /tmp/.vime 2>/dev/null; {prefix}timeout -s KILL {timeout:.3f} "
            f"{shlex.join(argv)} <&3 & pid=$!; echo $pid 2>/dev/null >{f}; wait $pid 2>/dev/null; rc=$?; "
            f"kill -9 -$pid 2>/dev/null; rm -f {f} 2>/dev/null; exit $rc"
        )

    async def _exec_raw(self, argv: list[str], *, stdin: bytes | None, timeout: float, env: dict[str, str],
                        cwd: str, user: str | None, max_output_bytes: int) -> RawExecResult:
        import asyncssh

        if self._conn is None:
            raise SandboxInfraError(f"localvm sandbox {self.sandbox_id}: not connected")
        if self._qemu is not None and self._qemu.returncode is not None:
            left = self.remaining_s()
            if left is not None and left <= 1.0:
                raise SandboxExpiredError(f"localvm sandbox {self.sandbox_id} reached its wall-time limit")
            raise SandboxInfraError(f"localvm sandbox {self.sandbox_id}: the VM is gone ({self._qemu.returncode})")
        pid_file = f"/tmp/.vime/exec-{uuid.uuid4().hex[:12]}.pid"
        command = self._command(argv, env, cwd, user, pid_file, timeout)
        try:
            proc = await self._conn.create_process(command, encoding=None)
        except (asyncssh.Error, OSError) as e:
            raise SandboxInfraError(f"localvm sandbox {self.sandbox_id}: ssh failed: {e}") from e
        out, err = _Sink(max_output_bytes), _Sink(max_output_bytes)
        readers = [asyncio.ensure_future(out.drain(proc.stdout)), asyncio.ensure_future(err.drain(proc.stderr))]
        t0 = time.monotonic()
        try:
            if stdin:
                proc.stdin.write(stdin)
            proc.stdin.write_eof()
            await wait_for(proc.wait(), timeout + 10.0)
            await wait_for(asyncio.gather(*readers), 5.0)
        except asyncio.TimeoutError:
            proc.close()
            await self._kill_exec(pid_file)
            for t in readers:
                t.cancel()
            return RawExecResult(TIMEOUT_EXIT_CODE, bytes(out.buf), bytes(err.buf), True, out.total > out.limit,
                                 err.total > err.limit)
        except asyncio.CancelledError:
            proc.close()
            for t in readers:
                t.cancel()
            await asyncio.shield(self._kill_exec(pid_file))
            raise
        except (asyncssh.Error, OSError) as e:
            left = self.remaining_s()
            if left is not None and left <= 1.0:  # the VM was killed at its wall-time limit
                return RawExecResult(TIMEOUT_EXIT_CODE, bytes(out.buf), bytes(err.buf), True, out.total > out.limit,
                                     err.total > err.limit)
            raise SandboxInfraError(f"localvm sandbox {self.sandbox_id}: ssh failed: {e}") from e
        elapsed = time.monotonic() - t0
        code = proc.exit_status
        if code is None or code < 0:
            if self._qemu is not None and self._qemu.returncode is not None:
                left = self.remaining_s()
                if left is None or left > 1.0:
                    raise SandboxInfraError(f"localvm sandbox {self.sandbox_id}: the VM died during the command")
                code = TIMEOUT_EXIT_CODE
            else:
                sig = proc.exit_signal[0] if proc.exit_signal else "KILL"
                code = 128 + getattr(signal, f"SIG{sig}", signal.SIGKILL)
        timed_out = code == TIMEOUT_EXIT_CODE and elapsed >= timeout * 0.95
        return RawExecResult(code, bytes(out.buf), bytes(err.buf), timed_out, out.total > out.limit,
                             err.total > err.limit)

    async def _kill_exec(self, pid_file: str) -> None:
        if self._conn is None:
            return
        with contextlib.suppress(Exception):
            await wait_for(self._conn.run(f"kill -9 -$(cat {pid_file}) 2>/dev/null; true"), 30)

    # -- reaper --------------------------------------------------------------------------------------------------
    @classmethod
    def cleanup(cls, *, everything: bool = False) -> CleanupReport:
        """Kill the QEMU processes and delete the overlays of sandboxes whose owner process is gone.

        :param everything: also those of running vime processes.
        """
        report = CleanupReport(cls.NAME)
        root = state_root()
        if root.exists():
            for d in sorted(root.iterdir()):
                if not d.is_dir() or not d.name.startswith("vime-localvm-"):
                    continue
                report.found.append(d.name)
                try:
                    meta = json.loads((d / "meta.json").read_text())
                except (OSError, ValueError):
                    meta = None
                if meta is None and not everything and time.time() - d.stat().st_mtime < 60:
                    continue
                if meta is not None and not everything and owner_alive(meta.get("owner", "")):
                    continue
                try:
                    _kill_vm(meta or {})
                    shutil.rmtree(d, ignore_errors=True)
                    report.removed.append(d.name)
                except Exception as e:  # noqa: BLE001
                    report.errors.append(f"{d.name}: {e}")
        for pid in _qemu_pids():  # QEMU processes whose state directory is gone
            sid = _env_of(pid).get(ENV_ID, "")
            if sid and not (root / sid).exists():
                report.found.append(f"qemu {sid}")
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
                report.removed.append(f"qemu {sid}")
        return report


class _PortTaken(Exception):
    pass


def _gid_expr(user: str) -> str:
    return str(user) if str(user).isdigit() else f"$(id -g {shlex.quote(user)})"


def _env_of(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(v.decode(errors="replace").split("=", 1) for v in raw.split(b"\0") if b"=" in v)


def _qemu_pids() -> list[int]:
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                comm = Path(f"/proc/{entry.name}/comm").read_text().strip()
            except OSError:
                continue
            if comm.startswith("vime-localvm-") or comm.startswith("qemu-system"):
                if _env_of(int(entry.name)).get(ENV_ID, "").startswith("vime-localvm-"):
                    pids.append(int(entry.name))
    return pids


def _kill_vm(meta: dict[str, Any]) -> None:
    pid, start = meta.get("qemu_pid"), meta.get("qemu_start")
    if pid and start and process_start_time(pid) == start:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
        for _ in range(250):
            if process_start_time(pid) != start or _is_zombie(pid):
                break
            time.sleep(0.02)


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def leftover_counts(ids: set[str] | None = None) -> dict[str, int]:
    """QEMU processes of vime sandboxes and their state directories on this host.

    :param ids: count only those of these sandbox ids.
    """
    root = state_root()
    dirs = [d for d in root.glob("vime-localvm-*") if d.is_dir()] if root.exists() else []
    vms = [p for p in _qemu_pids() if not _is_zombie(p)]
    if ids is not None:
        dirs = [d for d in dirs if d.name in ids]
        vms = [p for p in vms if _env_of(p).get(ENV_ID) in ids]
    return {"vms": len(vms), "directories": len(dirs)}
