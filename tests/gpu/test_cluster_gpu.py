"""The trainer group and engine actors on real GPUs (two H200s): Ray actors per rank, placement from the plan.

* The megatron backend as a Ray trainer group at TP=2 and at DP=2 (one actor per GPU, torch.distributed NCCL from
  the group's rendezvous): step-1 loss and grad norm equal the one-GPU group's within bf16 tolerance (at DP=2 each
  rank trains on one of the batch's two samples, :func:`vime_core.trainer.rl_step.dp_shard`).
* The torch backend is a one-rank backend: a 2-rank group is refused with a message naming the flags.
* The exact launch command and environment an engine actor uses for a TP=2 vLLM engine on a 2-GPU bundle (vLLM for
  CUDA is not installed on the GPU machine, so the engine is checked by its launch spec, not started).

Marked ``gpu``; skipped where Ray, two CUDA GPUs or megatron-core are missing. Ray starts a single-node cluster on
127.0.0.1 that sees the machine's GPUs; megatron-core must be importable by Ray's workers (``PYTHONPATH``).

On the lent 2×H200 (Python 3.12, no package index) this ran with wheels carried in ``.whl/`` — ray 2.60.0 (cp312,
79 MB: split in two pieces, joined with ``cat`` there), megatron-core 0.19.2, and Ray's needs missing there:
jsonschema, jsonschema-specifications, referencing, rpds-py, attrs::

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site:. python3 -m pytest tests/gpu/test_cluster_gpu.py -q -s    # 4 passed in 147 s

(That run predates the split of the batch over DP ranks; tests/gpu/test_vime_run_megatron_gpu.py drives the same
layouts through ``vime run``.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import vime_core  # noqa: F401 - before Ray: loopback environment

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA GPUs", allow_module_level=True)
ray = pytest.importorskip("ray")

from vime_core.cli.arguments import default_args  # noqa: E402
from vime_core.cluster.orchestration import init_ray, place, slot_options  # noqa: E402
from vime_core.config import ClusterConfig, RunConfig  # noqa: E402
from vime_core.plugins.manager import get_plugins  # noqa: E402
from vime_core.run.preflight import trainer_classes  # noqa: E402
from vime_core.testing import TrainerBackendContract  # noqa: E402
from vime_core.testing.trainer_args import trainer_config  # noqa: E402
from vime_core.trainer.group import TrainerGroup  # noqa: E402

BF16_RTOL = 2e-2


@pytest.fixture(scope="module")
def ray_2gpu():
    init_ray(num_cpus=8)
    assert ray.cluster_resources().get("GPU", 0) >= 2
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    pytest.importorskip("megatron.core")
    from tests.gpu.test_megatron_backend import build_hf

    return build_hf(tmp_path_factory.mktemp("llama") / "llama", "llama")


def _config(tmp: Path, gpus: int, trainer: str = "megatron", **kw) -> RunConfig:
    return trainer_config(
        lr=1e-3,
        trainer=trainer,
        weight_sync="disk",
        update_weight_disk_dir=tmp / "w",
        train_cpus=None,
        actor_num_nodes=1,
        actor_num_gpus_per_node=gpus,
        rollout_num_gpus=0,
        debug_train_only=True,
        **kw,
    )


def _step1(cfg: RunConfig, model: Path) -> tuple[dict[str, float], list[dict]]:
    plan, pg = place(cfg.cluster)
    group = TrainerGroup(cfg, model, trainer_classes(get_plugins(), cfg), plan, pg)
    try:
        metrics = group.train_step(TrainerBackendContract.make_batch(1000, 1.0))
        return metrics, group.placements()
    finally:
        group.shutdown()
        if pg is not None:
            ray.util.remove_placement_group(pg)


@pytest.fixture(scope="module")
def one_gpu(ray_2gpu, hf_dir, tmp_path_factory):
    return _step1(_config(tmp_path_factory.mktemp("g1"), 1), hf_dir)


@pytest.mark.parametrize("tp", [2, 1], ids=["tp2", "dp2"])
def test_megatron_group_of_two_matches_one_gpu(one_gpu, hf_dir, tmp_path, tp):
    ref, (r0,) = one_gpu
    metrics, where = _step1(_config(tmp_path, 2, tensor_model_parallel_size=tp), hf_dir)
    assert [(w["rank"], w["world_size"], w["env"]["LOCAL_RANK"]) for w in where] == [(0, 2, "0"), (1, 2, "0")]
    assert len({w["cuda_visible_devices"] for w in where}) == 2  # one distinct GPU per rank, chosen by Ray
    assert [w["cuda_visible_devices"] for w in where] == [",".join(w["gpu_ids"]) for w in where]
    assert where[0]["env"]["MASTER_ADDR"] == where[0]["node_ip"]
    print(
        f"tp={tp}: loss {metrics['train/pg_loss']} vs {ref['train/pg_loss']}, "
        f"grad norm {metrics['train/grad_norm']} vs {ref['train/grad_norm']}"
    )
    assert metrics["train/pg_loss"] == pytest.approx(ref["train/pg_loss"], rel=BF16_RTOL, abs=1e-3)
    assert metrics["train/grad_norm"] == pytest.approx(ref["train/grad_norm"], rel=BF16_RTOL)
    # the policy's log-probs of the batch (their gap to the rollout's -1.0 each) agree too: the same model was loaded
    key = "train/train_rollout_logprob_abs_diff"
    print(f"tp={tp}: |logp - rollout logp| {metrics[key]} vs {ref[key]}")
    assert metrics[key] == pytest.approx(ref[key], rel=BF16_RTOL)


def test_torch_backend_group_of_two_is_refused(ray_2gpu, tmp_path, tiny_model_dir):
    cfg = _config(tmp_path, 2, trainer="torch")
    plan, pg = place(cfg.cluster)
    group = TrainerGroup(cfg, tiny_model_dir, trainer_classes(get_plugins(), cfg), plan, pg)
    with pytest.raises(ray.exceptions.RayActorError, match="--trainer torch runs as one rank, but --actor-num-nodes"):
        group.placements()
    group.shutdown()
    ray.util.remove_placement_group(pg)


def test_tp2_engine_actor_launch_command_and_environment(ray_2gpu, tmp_path):
    from vime_core.engines.engine_actor import EngineActor

    args = default_args(
        actor_num_gpus_per_node=0, rollout_num_gpus=2, rollout_num_gpus_per_engine=2, debug_rollout_only=True
    )
    plan, pg = place(ClusterConfig.from_args(args))
    assert [(b.gpus, b.holds) for b in plan.bundles] == [(2, ["engine 0"])]
    actor = (
        ray.remote(EngineActor)
        .options(**slot_options(plan.engines[0], pg), max_concurrency=4)
        .remote(
            {
                "model": "/models/m",
                "served_model_name": "policy",
                "port": 30001,
                "extra_args": ["--dtype", "bfloat16", "--seed", "1"],
                "log_path": str(tmp_path / "e.log"),
            },
            None,
            2,
        )
    )
    spec = ray.get(actor.launch_spec.remote())
    ray.kill(actor)
    ray.util.remove_placement_group(pg)
    ids = spec["gpu_ids"]
    assert len(ids) == 2 and sorted(ids) == sorted(plan.bundles[0].gpu_ids)
    assert spec["env"]["CUDA_VISIBLE_DEVICES"] == ",".join(ids)
    assert spec["command"][1:] == [
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        "/models/m",
        "--host",
        spec["node_ip"],
        "--port",
        "30001",
        "--served-model-name",
        "policy",
        "--worker-extension-cls",
        "vime_core.engines.worker_extension.VimeWorkerExtension",
        "--enforce-eager",
        "--enable-scale-out",
        "--dtype",
        "bfloat16",
        "--seed",
        "1",
        "--tensor-parallel-size",
        "2",
    ]
    assert spec["env"]["VLLM_HOST_IP"] == spec["node_ip"] and spec["env"]["VLLM_SERVER_DEV_MODE"] == "1"
    print("TP=2 engine launch:", " ".join(spec["command"]), {k: spec["env"][k] for k in ("CUDA_VISIBLE_DEVICES",)})
