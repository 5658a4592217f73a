"""A server whose starter was killed (``kill -9`` of a run) is reaped by the next start
(:func:`vime_core.engines.process.reap_orphaned_servers`): vLLM's engine-core process outlives its API server and
its manager otherwise, holding GBs of memory (seen after the resume test's kills)."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from vime_core.engines.process import OWNER_ENV, reap_orphaned_servers
from vime_core.sandbox.base import owner_token

pytestmark = pytest.mark.unit


def _server(owner: str) -> subprocess.Popen:
    # a parent and its child in their own session, like an API server and its engine-core process
    return subprocess.Popen(
        ["sh", "-c", "sleep 60 & wait"], env={**os.environ, OWNER_ENV: owner}, start_new_session=True
    )


def test_a_server_of_a_dead_owner_is_killed_with_its_children_and_a_live_owners_is_kept():
    gone = subprocess.Popen(["sleep", "0.1"])
    dead_token = owner_token(gone.pid)
    gone.wait()
    orphan, kept = _server(dead_token), _server(owner_token())
    try:
        time.sleep(0.3)  # the child sleep has started
        orphan_group = [
            int(p)
            for p in subprocess.run(["pgrep", "-g", str(orphan.pid)], capture_output=True, text=True).stdout.split()
        ]
        assert len(orphan_group) == 2  # sh and its sleep
        killed = reap_orphaned_servers()
        assert set(orphan_group) <= set(killed) or orphan.pid in killed
        assert orphan.wait(timeout=5) == -9
        deadline = time.monotonic() + 5
        while subprocess.run(["pgrep", "-g", str(orphan.pid)], capture_output=True).returncode == 0:
            assert time.monotonic() < deadline, "the orphan's child survived"
            time.sleep(0.05)
        assert kept.poll() is None and kept.pid not in killed  # its owner (this process) is alive
    finally:
        for p in (orphan, kept):
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
