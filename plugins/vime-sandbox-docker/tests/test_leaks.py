"""A vime process holding 20 docker sandboxes mid-command is killed with SIGKILL: after the reaper (the next
sandbox start of another vime process, then `vime sandbox cleanup`) no vime container or volume is left."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from vime_sandbox_docker.sandbox import leftover_counts

from vime_core.testing.sandbox_leak import run_once, spawn_and_kill

pytestmark = [pytest.mark.integration, pytest.mark.exclusive]  # counts every process's leftovers
N = 20


def test_sigkill_mid_command_leaves_no_container_after_the_reaper(docker_image):
    before = leftover_counts()
    assert before == {"containers": 0, "volumes": 0, "host_dirs": 0}, f"vime containers left by earlier runs: {before}"
    ready_s = spawn_and_kill("docker", N)
    killed = leftover_counts()
    out = run_once("docker")  # its first sandbox start reaps the dead process's containers
    after_start = leftover_counts()
    cli = subprocess.run(
        [sys.executable, "-m", "vime_core.cli", "sandbox", "cleanup", "--backend", "docker", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    after_cli = leftover_counts()
    print(
        f"\ndocker leak test ({N} sandboxes, ready in {ready_s:.1f} s): after SIGKILL {killed}; after the next "
        f"sandbox start {after_start}; after `vime sandbox cleanup` {after_cli}"
    )
    assert killed["containers"] == N, killed
    assert "removed 20 leftovers" in out or "removed" in out
    assert after_start == {"containers": 0, "volumes": 0, "host_dirs": 0}
    assert cli.returncode == 0 and json.loads(cli.stdout)[0]["errors"] == []
    assert after_cli == {"containers": 0, "volumes": 0, "host_dirs": 0}
