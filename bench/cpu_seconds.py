"""Wall and CPU seconds of one command, every process it starts included (vLLM servers, Ray, QEMU VMs): the command
runs in a cgroup v1 ``cpuacct`` group of its own (tests/support/cpu_accounting.py), whose counter is the tree's CPU
time. Containers that dockerd starts are in dockerd's groups: the machine's CPU over the same time (every process) is
printed beside it. Needs root and a cgroup v1 ``cpuacct`` mount (as on CI's machines).

Usage::

    python bench/cpu_seconds.py -- .venv/bin/python -m pytest -m "not gpu and not extended" -n 2 --dist loadgroup
    python bench/cpu_seconds.py --label extended -- .venv/bin/python -m pytest -m "extended and not gpu" -n 2 \\
        --dist loadgroup

Prints ``[cpu_seconds] LABEL: wall W s, CPU C s (N cores busy); machine CPU M s ...`` and exits with the command's
exit code. Per test file: ``VIME_TEST_CPU_SECONDS_OUT=PATH`` (docs/testing.md, "Measuring").
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support of this checkout

from tests.support.cpu_accounting import (  # noqa: E402
    CpuGroup,
    current_group,
    format_figures,
    group_name,
    machine_usage_s,
    nested_name,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--label", default="command", help="name printed with the figures (default: command)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given: bench/cpu_seconds.py [--label NAME] -- COMMAND [ARG ...]")
    group = CpuGroup(nested_name(current_group(), group_name(f"cmd{os.getpid()}", "command")))
    machine0, t0 = machine_usage_s(), time.monotonic()
    proc = subprocess.Popen(command, preexec_fn=group.join)  # joins in the child, before exec: nothing escapes
    while True:
        try:
            rc = proc.wait()
            break
        except KeyboardInterrupt:  # the command got the terminal's SIGINT too: wait for it to end
            continue
    wall, cpu, machine = time.monotonic() - t0, group.usage_s(), machine_usage_s() - machine0
    print(f"[cpu_seconds] {args.label}: {format_figures(wall, cpu, machine)}; exit code {rc}", flush=True)
    left = group.remove()
    if left:
        print(
            f"[cpu_seconds] {len(left)} process(es) of the command still run in {group.path} (pids {left[:10]}); "
            "their CPU from now on is not counted"
        )
    return rc


if __name__ == "__main__":
    sys.exit(main())
