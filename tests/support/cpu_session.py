"""Opt-in CPU-seconds per test file (``VIME_TEST_CPU_SECONDS_OUT=PATH``, docs/testing.md "Measuring"): each pytest
process that runs tests (each xdist worker, or the one process without xdist) moves itself into a ``cpuacct`` group
of its own (:mod:`tests.support.cpu_accounting`), so what it starts is counted with it: vLLM servers, Ray, VMs. Each
test report carries the group's CPU seconds since the previous report (:data:`CPU_PROPERTY`), so a file's figure
is what its worker used while the file's tests ran (a shared engine idling meanwhile included). dockerd's containers
are not counted.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.support.cpu_accounting import CPUACCT_ROOT, CpuGroup, current_group, group_name, move_to, nested_name

#: the environment variable that turns the accounting on and names the JSON file written at the end
ENV = "VIME_TEST_CPU_SECONDS_OUT"
#: shared by the processes of one session (set by the first, inherited by the xdist workers)
SESSION_ENV = "VIME_TEST_CPU_SESSION"
#: the ``user_properties`` key of a test report carrying its CPU seconds
CPU_PROPERTY = "vime_cpu_s"


class CpuPerTest:
    """The plugin of a process that runs tests: its group's CPU seconds on every report."""

    def __init__(self, worker: str) -> None:
        """:raises CpuAccountingError: if the group cannot be created or joined (the message says what is needed)."""
        session = os.environ.setdefault(SESSION_ENV, str(os.getpid()))
        self.previous = current_group()
        self.group = CpuGroup(nested_name(self.previous, group_name(session, worker)))  # below: counted there too
        self.group.join()
        self.last = self.group.usage_s()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):  # noqa: ARG002 - pytest's hook signature
        outcome = yield
        now = self.group.usage_s()
        outcome.get_result().user_properties.append((CPU_PROPERTY, now - self.last))
        self.last = now

    def pytest_unconfigure(self, config) -> None:  # noqa: ARG002 - pytest's hook signature
        move_to(CPUACCT_ROOT, self.previous)
        left = self.group.remove()
        if left:
            print(f"[cpu] {len(left)} process(es) still in {self.group.path}: {left[:10]}")


def start(config: pytest.Config) -> None:
    """Register :class:`CpuPerTest` in a process that runs tests: an xdist worker, or a run without workers (the
    xdist controller only sets the session id its workers inherit)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None and getattr(config.option, "numprocesses", None):
        os.environ.setdefault(SESSION_ENV, str(os.getpid()))
        return
    config.pluginmanager.register(CpuPerTest(worker or "main"), "vime-cpu-seconds")


def write(path: str, seconds: dict[str, float], cpu: dict[str, float]) -> None:
    """``{"seconds": W, "cpu_seconds": C, "files": {file: {"seconds": w, "cpu_seconds": c}}}`` to ``path``, the
    files longest first."""
    files = sorted(seconds, key=lambda f: -seconds[f])
    rows = {f: {"seconds": round(seconds[f], 1), "cpu_seconds": round(cpu.get(f, 0.0), 1)} for f in files}
    total = {"seconds": round(sum(seconds.values()), 1), "cpu_seconds": round(sum(cpu.values()), 1)}
    Path(path).write_text(json.dumps({**total, "files": rows}, indent=1) + "\n")
