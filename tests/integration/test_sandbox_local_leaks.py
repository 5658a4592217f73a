"""Leak and isolation figures of the built-in ``local`` sandbox: a vime process killed with SIGKILL mid-command
leaves nothing after the reaper; sandboxed code cannot see or touch the host's processes and files."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest

from vime_core.sandbox import SandboxLimits
from vime_core.sandbox.local import LocalSandbox, host_mode, leftover_counts
from vime_core.testing.sandbox_leak import run_once, spawn_and_kill

pytestmark = [pytest.mark.integration, pytest.mark.exclusive]  # counts every process's leftovers
N = 20


def _cli_cleanup() -> list[dict]:
    out = subprocess.run(
        [sys.executable, "-m", "vime_core.cli", "sandbox", "cleanup", "--backend", "local", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout)


def test_sigkill_mid_command_leaves_nothing_after_the_reaper():
    assert leftover_counts() == {"processes": 0, "directories": 0, "cgroups": 0} or _cli_cleanup()
    # round 1: the reaper runs at the next sandbox start in a new vime process
    ready_s = spawn_and_kill("local", N)
    killed = leftover_counts()
    run_once("local")
    after_next_start = leftover_counts()
    # round 2: the reaper runs from `vime sandbox cleanup`
    spawn_and_kill("local", N)
    killed2 = leftover_counts()
    report = _cli_cleanup()
    after_cli = leftover_counts()
    print(
        f"\nlocal leak test ({host_mode()['mode']}, {N} sandboxes, ready in {ready_s:.1f} s): after SIGKILL "
        f"{killed}; after the next start {after_next_start}; second round after SIGKILL {killed2}; after "
        f"`vime sandbox cleanup` {after_cli} (removed {len(report[0]['removed'])})"
    )
    assert killed["directories"] == N
    assert after_next_start == {"processes": 0, "directories": 0, "cgroups": 0}
    assert killed2["directories"] == N
    assert after_cli == {"processes": 0, "directories": 0, "cgroups": 0}
    assert len(report[0]["removed"]) == N


@pytest.mark.skipif(host_mode()["mode"] != "namespaces", reason="process-group mode does not isolate")
def test_sandbox_cannot_see_or_signal_host_processes(tmp_path):
    host = subprocess.Popen(["sleep", "60"])
    marker = tmp_path / "host-file"
    marker.write_text("host")

    async def body():
        async with LocalSandbox(limits=SandboxLimits(wall_time_s=60)) as sb:
            ps = await sb.exec("ls /proc | grep -c '^[0-9]'", timeout=30)
            kill = await sb.exec(f"kill -9 {host.pid}", timeout=30)
            rm = await sb.exec(f"rm -f {marker}; echo x > {marker}", timeout=30)
            return int(ps.stdout), kill.exit_code, rm.exit_code

    try:
        n_procs, kill_rc, rm_rc = asyncio.run(body())
        print(f"\nprocesses visible inside: {n_procs}; kill host pid rc={kill_rc}; overwrite host file rc={rm_rc}")
        assert n_procs <= 4  # init, the shell, ls, grep
        assert kill_rc != 0 and host.poll() is None
        assert rm_rc != 0 and marker.read_text() == "host"
    finally:
        host.kill()
        host.wait()


def test_environment_is_clean():
    os.environ["VIME_TEST_SECRET"] = "do-not-leak"
    try:

        async def body():
            async with LocalSandbox() as sb:
                return (await sb.exec("env", timeout=30)).stdout

        env = asyncio.run(body())
    finally:
        del os.environ["VIME_TEST_SECRET"]
    assert "do-not-leak" not in env and "VIME_SANDBOX_ID=vime-local-" in env
