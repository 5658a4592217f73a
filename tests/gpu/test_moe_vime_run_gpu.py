"""``vime run --trainer megatron --colocate --weight-sync ipc`` on one GPU with the tiny Qwen3-MoE of
vime_core/testing/tiny_moe.py (random weights, its locally trained tokenizer), 3 steps, with and without
``--use-rollout-routing-replay``: non-empty responses whose rewards come from their text
(``tests/integration/text_reward.py``), every sample of the R3 run carrying the engine's routes (int16, one row per
forwarded token), the weights reaching the engine under the checkpoint's per-expert names (|Δlogp| small every step),
and |Δlogp| of the two runs side by side.

Marked ``gpu``; skipped without CUDA, vLLM for CUDA, Ray or megatron-core. With the offline site of docs/gpu.md
(~5 min on one H100: two runs of ~2.5 min, most of it Ray and engine start-up)::

    PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 python3 -m pytest tests/gpu/test_moe_vime_run_gpu.py -q -s
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("vllm")
pytest.importorskip("ray")
pytest.importorskip("megatron.core")

from vime_core.testing.tiny_moe import build_tiny_moe  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
#: bf16 engine vs bf16 Megatron trainer, mean |Δlogp| over the trained tokens: "the engine serves the trainer's
#: weights" (a weight that did not arrive, e.g. an expert under a wrong name, gives ~1 and more)
LOGP_TOL = 0.1


def vime_run(model: Path, out: Path, r3: bool) -> list[dict]:
    argv = [
        *("run", "--model", str(model), "--output-dir", str(out), "--trainer", "megatron", "--colocate"),
        *("--actor-num-gpus-per-node", "1", "--weight-sync", "ipc", "--rollout-enforce-eager"),
        *("--prompt-data", str(ROOT / "examples/quickstart/data/train.jsonl")),
        *("--reward", "tests.integration.text_reward.text_length_mod3"),
        *("--num-rollout", str(STEPS), "--rollout-batch-size", "8", "--n-samples-per-prompt", "4"),
        *("--rollout-max-response-len", "48", "--rollout-temperature", "1.0"),
        *("--global-batch-size", "32", "--micro-batch-size", "8", "--lr", "1e-5"),
        *("--save-debug-rollout-data", str(out / "debug" / "r_{rollout_id}.pt"), "--no-report", "--no-save-hf"),
        *(["--use-rollout-routing-replay"] if r3 else []),
    ]
    log = out.with_suffix(".log")
    out.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        rc = subprocess.run(
            [sys.executable, "-m", "vime_core.cli", *argv],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            cwd=ROOT,
            timeout=900,
        ).returncode
    assert rc == 0, f"vime {' '.join(argv)} exited {rc}:\n{log.read_text()[-8000:]}"
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[bool, tuple[Path, list[dict]]]:
    root = tmp_path_factory.mktemp("moe-runs")
    model = build_tiny_moe(root / "qwen3_moe", "qwen3_moe")
    return {r3: (root / f"r3_{r3}", vime_run(model, root / f"r3_{r3}", r3)) for r3 in (False, True)}


def test_responses_rewards_routes_and_logp_side_by_side(runs):
    from vime_core.run.debug_rollout import load_debug_rollout

    for r3, (out, metrics) in runs.items():
        assert [m["step"] for m in metrics] == list(range(STEPS))
        for step in range(STEPS):
            samples = [s for g in load_debug_rollout(str(out / "debug" / "r_{rollout_id}.pt"), step) for s in g]
            assert len(samples) == 32
            for s in samples:
                assert s.status.value in ("completed", "truncated") and s.response_length > 0
                assert s.reward == float(len(s.response) % 3)
                if r3:
                    assert s.routed_experts.dtype == np.int16 and s.routed_experts.shape == (len(s.tokens) - 1, 2, 2)
                    assert 0 <= s.routed_experts.min() and s.routed_experts.max() < 8
                else:
                    assert s.routed_experts is None
        for m in metrics:
            assert m["train/train_rollout_logprob_abs_diff"] < LOGP_TOL, m
            assert m["train/grad_norm"] > 0 and m["weight_sync/bytes"] > 0
    print("step  |Δlogp| without R3  |Δlogp| with R3")
    for plain, replay in zip(runs[False][1], runs[True][1], strict=True):
        key = "train/train_rollout_logprob_abs_diff"
        print(f"{plain['step']:4d}  {plain[key]:18.5f}  {replay[key]:15.5f}")
