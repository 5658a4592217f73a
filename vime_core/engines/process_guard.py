"""The guard a managed server runs under: ``python process_guard.py GRACE_S STARTER_PID -- COMMAND...`` (run by file
path, so it imports nothing of vime).

The guard leads the server's process group and stops the whole group (SIGTERM, then SIGKILL after ``GRACE_S``) when
the process that started it dies, ``kill -9`` included; a watcher child stops the group if the guard itself is
killed. With ``VIME_CPU_AFFINITY=0,1,...`` in its environment the guard starts the server on those cores only (Linux
``sched_setaffinity``; every process and thread the server starts inherits it). ``--reap-run KEY VALUE GRACE_S
STARTER_PID`` is the run reaper (:func:`vime_core.engines.process.start_run_reaper`).
How and why: docs/engine_health.md, "No process outlives the run".
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

PARENT_DEATH_SIGNAL = signal.SIGUSR1

#: sent by the driver to the run reaper once its own cleanup is done: reap now (see :func:`reap_run`)
REAP_NOW_SIGNAL = signal.SIGUSR1
#: environment variable: comma-separated CPU ids the guarded server is pinned to
CPU_AFFINITY_ENV = "VIME_CPU_AFFINITY"


def _set_parent_death_signal(sig: int) -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(sig))  # PR_SET_PDEATHSIG = 1
    except OSError:
        pass


def process_table() -> dict[int, tuple[int, int, str]]:
    """``{pid: (parent pid, process group, start time in clock ticks)}`` of the live (not zombie) processes, read from
    ``/proc/<pid>/stat``."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[-1].split()  # after "pid (comm)": state ppid pgrp ... starttime
        except OSError:  # gone meanwhile
            continue
        if len(fields) > 19 and fields[0] != "Z":
            table[int(entry)] = (int(fields[1]), int(fields[2]), fields[19])
    return table


def group_members(pgid: int) -> list[int]:
    """Pids of the live processes of process group ``pgid`` (read from ``/proc``; this process excluded)."""
    return [pid for pid, (_, pgrp, _) in process_table().items() if pgrp == pgid and pid != os.getpid()]


def stop_group(pgid: int, grace_s: float, spare: tuple[int, ...] = ()) -> None:
    """SIGTERM every other process of group ``pgid`` (but ``spare``), SIGKILL those left after ``grace_s``."""
    members = [p for p in group_members(pgid) if p not in spare]
    if not members:
        return
    for pid in members:
        _signal(pid, signal.SIGTERM)
    end = time.monotonic() + grace_s
    while time.monotonic() < end and [p for p in group_members(pgid) if p not in spare]:
        time.sleep(0.1)
    for pid in group_members(pgid):
        if pid not in spare:
            _signal(pid, signal.SIGKILL)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _watch_parent(parent: int) -> list[bool]:
    """Handlers so that a stop of the group waits for the server, and the death of ``parent`` (the pid that started
    this process) is noticed; returns a flag list set once it is gone.

    ``parent`` comes from the starter, not from ``os.getppid()`` here: a starter that dies before this process has
    armed its parent-death signal (a loaded machine may take a second to get here) leaves it with another parent
    already, which ``os.getppid() != parent`` right after arming catches."""
    gone = [False]

    def on_parent_signal(signum: int, frame: object) -> None:
        gone[0] = gone[0] or os.getppid() != parent

    signal.signal(PARENT_DEATH_SIGNAL, on_parent_signal)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: None)  # a stop of the group: the server got it too; wait for the server
    _set_parent_death_signal(PARENT_DEATH_SIGNAL)
    gone[0] = gone[0] or os.getppid() != parent  # gone before the signal was armed
    return gone


def watch(grace_s: float, parent: int) -> int:
    """The watcher: a child of the guard (pid ``parent``) in the same group. When the guard dies without its cleanup
    (Ray SIGKILLs a dead worker's direct children, the guard among them), the watcher stops the group."""
    gone = _watch_parent(parent)
    while not gone[0] and os.getppid() == parent:
        time.sleep(0.5)
    stop_group(os.getpgrp(), grace_s)
    return 0


def marked_processes(key: str, value: str) -> list[int]:
    """Pids of the live processes (this one excluded) whose environment has ``key=value``."""
    needle = f"{key}={value}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[-1].split()
        except OSError:  # gone meanwhile
            continue
        if fields and fields[0] != "Z":
            found.append(int(entry))
    return found


def descendants(root: int, table: dict[int, tuple[int, int, str]]) -> dict[int, str]:
    """``{pid: start time}`` of every process below ``root`` in ``table`` (:func:`process_table`)."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = {}, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        if pid not in found:
            found[pid] = table[pid][2]
            todo += children.get(pid, [])
    return found


def reap_run(key: str, value: str, grace_s: float, parent: int) -> int:
    """The run reaper: once the driver that started it (pid ``parent``) is gone (however it ended), wait ``grace_s``
    for the guards and Ray to stop their processes, then SIGKILL every process still carrying the run's marker
    ``key=value`` (Ray's GCS, raylet and agents included, which can outlive a killed driver), scanning again for a few
    seconds.

    A process may overwrite its environment with its title (Ray's agents do: ``ray::DashboardAgent`` reads an empty
    ``/proc/<pid>/environ``), so the reaper also remembers the driver's descendants while the driver lives (every
    0.5 s) and kills those still alive as the same process (same start time) after it.

    :data:`REAP_NOW_SIGNAL` from the driver (:func:`vime_core.engines.process.finish_run_reaper`, after its own
    cleanup on a signal) starts the reaping at once, without the grace, and ends it after 1 quiet second, so the
    driver can wait for the reaper before it says that every process is gone."""
    gone = _watch_parent(parent)
    now = [False]
    signal.signal(REAP_NOW_SIGNAL, lambda *_: now.__setitem__(0, True))
    seen: dict[int, str] = {}
    while not gone[0] and not now[0] and os.getppid() == parent:
        seen.update(descendants(parent, process_table()))
        time.sleep(0.5)
    seen.pop(os.getpid(), None)
    if now[0]:
        grace_s = 0.0

    def left() -> list[int]:
        table = process_table()
        same = [pid for pid, start in seen.items() if pid in table and table[pid][2] == start]
        return sorted(set(marked_processes(key, value)) | set(same))

    end = time.monotonic() + grace_s
    while left() and time.monotonic() < end:
        time.sleep(0.2)
    quiet_s = 1.0 if now[0] else 3.0
    quiet_until = time.monotonic() + quiet_s  # until no process of the run was seen for quiet_s
    while time.monotonic() < quiet_until:
        pids = left()
        for pid in pids:
            _signal(pid, signal.SIGKILL)
        if pids:
            quiet_until = time.monotonic() + quiet_s
        time.sleep(0.3)
    return 0


def main(argv: list[str]) -> int:
    """The guard: start the watcher and the server, wait for the server; see the module docstring."""
    if argv[0] == "--watch":
        return watch(float(argv[1]), int(argv[2]))
    if argv[0] == "--reap-run":
        return reap_run(argv[1], argv[2], float(argv[3]), int(argv[4]))
    grace_s, parent = float(argv[0]), int(argv[1])
    command = argv[argv.index("--") + 1 :]
    pgid = os.getpgrp()
    gone = _watch_parent(parent)
    watcher = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--watch", str(grace_s), str(os.getpid())])
    cpus = os.environ.get(CPU_AFFINITY_ENV)
    if cpus:  # pin the server (it inherits the guard's affinity), not the watcher started above
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
    child = subprocess.Popen(command, restore_signals=True)
    spare = (watcher.pid,)
    deadline = None
    while True:
        try:
            rc = child.wait(timeout=0.5)
            break
        except subprocess.TimeoutExpired:
            pass
        gone[0] = gone[0] or os.getppid() != parent
        if gone[0] and deadline is None:
            print(f"[vime guard] the process that started pid {child.pid} is gone: stopping its group", flush=True)
            for pid in group_members(pgid):
                if pid != watcher.pid:
                    _signal(pid, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
        if deadline is not None and time.monotonic() > deadline:
            for pid in group_members(pgid):
                if pid != watcher.pid:
                    _signal(pid, signal.SIGKILL)
    # the server is gone: nothing it started may stay (engine-core and worker processes)
    stop_group(pgid, min(grace_s, 2.0) if gone[0] else grace_s, spare)
    watcher.kill()
    watcher.wait()
    if rc < 0:  # exit as the server did: by the same signal
        signal.signal(-rc, signal.SIG_DFL)
        os.kill(os.getpid(), -rc)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
