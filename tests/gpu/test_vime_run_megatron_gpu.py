"""``vime run --trainer megatron --debug-train-only --load-debug-rollout-data`` on two GPUs (two H200s): the trainer
group as Ray actors at TP=2 and at DP=2 against the one-GPU run.

The rollout data is built here (2 prompts × 4 samples, 16 prompt + 48 response tokens, rewards 0/1 within each group,
engine log-probs -3.0) and saved with :func:`vime_core.run.debug_rollout.save_debug_rollout`; the model is a small
random Llama (8 heads, 2 KV groups, vocabulary 1000). One GRPO step with ``--global-batch-size 4 --micro-batch-size
1``: two optimizer steps, the second on weights the first changed, so step 1's ``train/pg_loss`` is not the loss at
ratio 1 alone. At DP=2 each rank trains on two samples of each mini-batch (:func:`vime_core.trainer.rl_step.dp_shard`).

Marked ``gpu``; skipped without CUDA (the two-GPU comparisons: without two GPUs), Ray or megatron-core (which must
be importable by Ray's workers: ``PYTHONPATH``). With the wheels of tests/gpu/test_cluster_gpu.py (megatron-core
0.16.1 also works) plus pebble (the built-in rewards import it; the GPU image lacks it)::

    PYTHONPATH=/tmp/site:$PWD python3 -m pytest tests/gpu/test_vime_run_megatron_gpu.py -q -s

On one H200 (the only kind lent when this was written): the one-GPU test passed (47 s for the module, Ray's start
included); on two H200s (2026-12-01) all three passed (figures in docs/cluster.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("ray")
pytest.importorskip("megatron.core")

from vime_core.run.debug_rollout import save_debug_rollout  # noqa: E402
from vime_core.types import Sample, Status  # noqa: E402

BF16_RTOL = 2e-2
KEYS = ("train/pg_loss", "train/grad_norm", "train/train_rollout_logprob_abs_diff", "train/pg_clipfrac")


def debug_rollout(pattern: str, vocab: int = 1000) -> Path:
    """Save step 0's groups (2 × 4 samples) under ``pattern`` and return the file."""
    g = torch.Generator().manual_seed(7)
    groups = []
    for gi in range(2):
        group = []
        for i in range(4):
            s = Sample(
                group_index=gi,
                index=gi * 4 + i,
                tokens=torch.randint(0, vocab, (16,), generator=g).tolist(),
                status=Status.COMPLETED,
                reward=float(i % 2),
            )
            s.append_response_tokens(
                torch.randint(0, vocab, (48,), generator=g).tolist(),
                trainable=True,
                log_probs=[-3.0] * 48,
                weight_version=0,
            )
            group.append(s)
        groups.append(group)
    return save_debug_rollout(pattern, 0, groups)


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple[Path, str]:
    from tests.gpu.test_megatron_backend import build_hf

    root = tmp_path_factory.mktemp("vime-run-megatron")
    model = build_hf(root / "llama", "llama")
    pattern = str(root / "debug" / "rollout_{rollout_id}.pt")
    debug_rollout(pattern)
    return model, pattern


def vime_run(model: Path, pattern: str, out: Path, gpus: int, tp: int) -> dict[str, float]:
    """``vime run`` as a subprocess; step 0's metrics from ``metrics.jsonl``."""
    argv = [
        *("run", "--trainer", "megatron", "--model", str(model), "--output-dir", str(out)),
        *("--load-debug-rollout-data", pattern, "--num-rollout", "1"),
        *("--rollout-batch-size", "2", "--n-samples-per-prompt", "4"),
        *("--global-batch-size", "4", "--micro-batch-size", "1", "--lr", "1e-4", "--no-save-hf"),
        *("--actor-num-gpus-per-node", str(gpus), "--tensor-model-parallel-size", str(tp)),
        *("--update-weight-disk-dir", str(out / "weights")),
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, "-m", "vime_core.cli", *argv], capture_output=True, text=True, timeout=600, env=env
    )
    assert proc.returncode == 0, f"vime {' '.join(argv)}: {proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    (line,) = (out / "metrics.jsonl").read_text().splitlines()
    placed = json.loads((out / "placement.json").read_text())["trainer"]
    assert [p["rank"] for p in placed] == list(range(gpus))
    assert len({p["cuda_visible_devices"] for p in placed}) == gpus  # one GPU per rank, chosen by Ray
    return json.loads(line)


@pytest.fixture(scope="module")
def one_gpu(setup, tmp_path_factory) -> dict[str, float]:
    model, pattern = setup
    return vime_run(model, pattern, tmp_path_factory.mktemp("g1"), 1, 1)


def test_vime_run_megatron_one_gpu(one_gpu):
    """The one-GPU run itself: every sample trained, finite loss and gradient norm, the optimizer moved the policy
    between the two mini-batches (``ppo_kl`` of the second is not 0)."""
    print("one GPU:", {k: one_gpu[k] for k in (*KEYS, "train/ppo_kl", "perf/train_time")})
    assert one_gpu["train/num_tokens"] == 8 * 48 and one_gpu["rollout/num_trained_samples"] == 8
    assert one_gpu["train/grad_norm"] > 0 and abs(one_gpu["train/pg_loss"]) < 1.0
    assert one_gpu["train/ppo_kl"] != 0.0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("tp", [2, 1], ids=["tp2", "dp2"])
def test_vime_run_megatron_on_two_gpus_matches_one_gpu(one_gpu, setup, tmp_path, tp):
    model, pattern = setup
    metrics = vime_run(model, pattern, tmp_path, 2, tp)
    for key in KEYS:
        print(f"{'TP=2' if tp == 2 else 'DP=2'} {key}: {metrics[key]!r} vs one GPU {one_gpu[key]!r}")
    assert metrics["train/num_tokens"] == one_gpu["train/num_tokens"] == 8 * 48
    assert metrics["train/pg_loss"] == pytest.approx(one_gpu["train/pg_loss"], rel=BF16_RTOL, abs=1e-3)
    assert metrics["train/grad_norm"] == pytest.approx(one_gpu["train/grad_norm"], rel=BF16_RTOL)
    key = "train/train_rollout_logprob_abs_diff"
    assert metrics[key] == pytest.approx(one_gpu[key], rel=BF16_RTOL)
