"""Ray, as vime starts it, lives on 127.0.0.1 only: node address, actors and every listening socket; and its workers
run at the niceness asked for (``--ray-worker-niceness``, default 0), not Ray's 15."""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

SCRIPT = r"""
import os, sys
import psutil
from vime_core.cluster.orchestration import init_ray, remote_actor
import ray

class Probe:
    def ip(self):
        return ray.util.get_node_ip_address()

    def nice(self):
        return os.nice(0)

init_ray(num_cpus=2, worker_niceness=int(sys.argv[1]))
actor = remote_actor(Probe)
print("actor_ip", ray.get(actor.ip.remote()))
print("actor_nice", ray.get(actor.nice.remote()))
print("node_ip", ray.util.get_node_ip_address())
ours = {p.pid for p in psutil.Process().children(recursive=True)} | {psutil.Process().pid}
bad = []
checked = 0
for c in psutil.net_connections(kind="inet"):
    if c.status != psutil.CONN_LISTEN or c.pid not in ours:  # this Ray instance only (GCS, raylet, workers)
        continue
    checked += 1
    try:
        name = " ".join(psutil.Process(c.pid).cmdline())
    except psutil.Error:
        continue
    loopback = c.laddr.ip in ("127.0.0.1", "::ffff:127.0.0.1")
    if ("ray" in name or "gcs_server" in name or "raylet" in name) and not loopback:
        bad.append((c.laddr.ip, c.laddr.port, name[:80]))
print("non_loopback_listeners", bad)
print("checked_listeners", checked)
ray.shutdown()
"""


@pytest.mark.parametrize("niceness", [0, 7])
def test_ray_binds_loopback_only(niceness):
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(niceness)], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
    assert lines["actor_ip"] == "127.0.0.1"
    assert lines["node_ip"] == "127.0.0.1"
    assert lines["actor_nice"] == str(niceness)
    assert lines["non_loopback_listeners"] == "[]"
    assert int(lines["checked_listeners"]) >= 3  # GCS, raylet, a worker at least: the check is not vacuous
