"""Owner tokens: which process created a sandbox resource (host, boot, pid, process start time), and whether it
still runs; and the process-table reads behind them (``/proc``)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

LABEL = "vime.sandbox"  # label/tag key on every resource a backend creates; its value is the sandbox id
OWNER_LABEL = "vime.owner"  # label holding owner_token() of the creating process
BACKEND_LABEL = "vime.backend"


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:8]
    except OSError:
        return "noboot"


def processes_with_env(name: str) -> dict[int, str]:
    """Processes on this host whose environment sets ``name``: pid → its value (read from ``/proc/PID/environ``;
    processes that end meanwhile or cannot be read are left out)."""
    prefix = f"{name}=".encode()
    found: dict[int, str] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        for var in env.split(b"\0"):
            if var.startswith(prefix):
                found[int(entry.name)] = var[len(prefix) :].decode(errors="replace")
                break
    return found


def process_start_time(pid: int) -> str | None:
    """Start time of ``pid`` in clock ticks since boot (``/proc/PID/stat`` field 22), or ``None`` if not running."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def owner_token(pid: int | None = None) -> str:
    """``host:boot:pid:starttime`` of this process (or ``pid``): unique across pid reuse and reboots."""
    pid = os.getpid() if pid is None else pid
    return f"{socket.gethostname()}:{_boot_id()}:{pid}:{process_start_time(pid)}"


def owner_alive(token: str) -> bool:
    """Whether the process named by an :func:`owner_token` still runs.

    A token from another host cannot be checked and counts as alive (``vime sandbox cleanup --all`` removes those).
    """
    try:
        host, boot, pid, start = token.rsplit(":", 3)
    except ValueError:
        return False
    if host != socket.gethostname():
        return True
    if boot != _boot_id():
        return False
    return process_start_time(int(pid)) == start
