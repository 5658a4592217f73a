"""CPU-seconds of a process tree, read from a cgroup v1 ``cpuacct`` group it runs in: every process started inside a
group stays in it (vLLM servers, Ray, QEMU), so the group's ``cpuacct.usage`` is the tree's CPU time, whatever
reparenting or double forks happen. Containers that dockerd starts are in dockerd's own groups and not counted.

Used by the opt-in per-file CPU accounting of the test session (tests/conftest.py, ``VIME_TEST_CPU_SECONDS_OUT``) and
by ``bench/cpu_seconds.py`` (one command's wall and CPU seconds). docs/testing.md, "Measuring".
"""

from __future__ import annotations

import os
from pathlib import Path

#: where the cgroup v1 ``cpuacct`` hierarchy is mounted
CPUACCT_ROOT = Path("/sys/fs/cgroup/cpuacct")
#: the folder under :data:`CPUACCT_ROOT` holding the groups this module creates
GROUP_PARENT = "vime-tests"


class CpuAccountingError(RuntimeError):
    """No writable cgroup v1 ``cpuacct`` hierarchy: the message names the path and what is needed."""


def read_usage_s(group_dir: Path) -> float:
    """The CPU seconds (user + system, every CPU) the group's processes used since it was created.

    :param group_dir: a ``cpuacct`` group's directory (its ``cpuacct.usage`` holds nanoseconds).
    :raises CpuAccountingError: if ``cpuacct.usage`` is missing or not an integer, naming the file.
    """
    path = group_dir / "cpuacct.usage"
    try:
        return int(path.read_text().strip()) / 1e9
    except (OSError, ValueError) as e:
        raise CpuAccountingError(f"{path}: cannot read a nanosecond count ({e})") from None


def group_name(session: str, worker: str) -> str:
    """The group of one pytest process: ``vime-tests/<session>-<worker>`` (``worker`` is ``gw0``, ``gw1`` or
    ``controller``; ``session`` is what every process of one run shares)."""
    for part in (session, worker):
        if not part or "/" in part or part in (".", ".."):
            raise ValueError(f"not a cgroup name part: {part!r}")
    return f"{GROUP_PARENT}/{session}-{worker}"


class CpuGroup:
    """A ``cpuacct`` group under :data:`CPUACCT_ROOT` (created if missing) that processes join."""

    def __init__(self, name: str, root: Path = CPUACCT_ROOT) -> None:
        """:raises CpuAccountingError: if the group cannot be created (no cgroup v1 ``cpuacct`` mount, not root)."""
        self.root = root
        self.path = root / name
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CpuAccountingError(
                f"{self.path}: cannot create a cpuacct group ({e}); measuring CPU-seconds needs a writable cgroup v1 "
                f"cpuacct hierarchy at {root} (root on a cgroup v1 or hybrid host)"
            ) from None

    def join(self, pid: int = 0) -> None:
        """Move process ``pid`` (0: the calling process) into the group; its children from now on are born in it.

        :raises CpuAccountingError: naming the group if the kernel refuses.
        """
        try:
            (self.path / "cgroup.procs").write_text(f"{pid or os.getpid()}\n")
        except OSError as e:
            raise CpuAccountingError(f"{self.path}: cannot join the group ({e})") from None

    def usage_s(self) -> float:
        """CPU seconds used in the group so far (:func:`read_usage_s`)."""
        return read_usage_s(self.path)

    def pids(self) -> list[int]:
        """The processes in the group now."""
        return [int(x) for x in (self.path / "cgroup.procs").read_text().split()]

    def remove(self) -> list[int]:
        """Remove the group if no process is in it any more.

        :return: the pids still in it (then it is kept; ``rmdir`` it once they are gone).
        """
        left = self.pids()
        if not left:
            try:
                self.path.rmdir()
            except OSError:  # a process joined meanwhile
                return self.pids()
            try:
                self.path.parent.rmdir()  # GROUP_PARENT, once no other group is in it
            except OSError:
                pass
        return left


def cpuacct_group_of(proc_cgroup: str) -> str:
    """The ``cpuacct`` group path in the text of ``/proc/PID/cgroup`` (lines ``ID:CONTROLLERS:PATH``).

    :raises CpuAccountingError: if no line lists the ``cpuacct`` controller (no cgroup v1 ``cpuacct`` hierarchy).
    """
    for line in proc_cgroup.splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpuacct" in controllers.split(","):
            return path
    raise CpuAccountingError("no cgroup v1 cpuacct hierarchy in /proc/self/cgroup")


def current_group() -> str:
    """The calling process's ``cpuacct`` group (``/`` at the root).

    :raises CpuAccountingError: without a cgroup v1 ``cpuacct`` hierarchy.
    """
    return cpuacct_group_of(Path("/proc/self/cgroup").read_text())


def nested_name(parent: str, name: str) -> str:
    """``name`` under the group ``parent`` (a path as :func:`cpuacct_group_of` returns): groups are hierarchical, so
    the parent's counter goes on including what is measured below it (a run measured as a whole and per file)."""
    return "/".join(p for p in (parent.strip("/"), name) if p)


def move_to(root: Path, group: str, pid: int = 0) -> None:
    """Move process ``pid`` (0: the calling one) to ``group``, a path as :func:`cpuacct_group_of` returns."""
    (root / group.lstrip("/") / "cgroup.procs").write_text(f"{pid or os.getpid()}\n")


def machine_usage_s(root: Path = CPUACCT_ROOT) -> float:
    """CPU seconds every process on the machine used since boot (the root group's counter)."""
    return read_usage_s(root)


def format_figures(wall_s: float, cpu_s: float, machine_s: float | None = None) -> str:
    """One line: wall seconds, CPU seconds and the mean cores busy, e.g.
    ``wall 120.0 s, CPU 200.0 s (1.67 cores busy)``; with ``machine_s`` also the machine's CPU seconds over the
    same time (every process, dockerd's containers included)."""
    cores = cpu_s / wall_s if wall_s > 0 else 0.0
    line = f"wall {wall_s:.1f} s, CPU {cpu_s:.1f} s ({cores:.2f} cores busy)"
    if machine_s is not None:
        line += f"; machine CPU {machine_s:.1f} s over the same time (every process, containers included)"
    return line
