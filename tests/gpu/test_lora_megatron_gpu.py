"""LoRA on the GPU: ``vime run --trainer megatron --lora-rank 16`` on one GPU, colocated with a CUDA vLLM engine that
serves the adapter through vLLM's runtime LoRA API; ``ipc`` (the adapter's CUDA tensors handed over by handle, staged
in the workers' memory) and ``disk`` (PEFT files) adapter sync (docs/lora.md).

Passed on one H200 on 2026-12-02 (figures in docs/lora.md). Checked:
exit 0; only the adapter moves (``weight_sync/bytes`` ≈ 2 × 4.9 M parameters' bytes, far below the 269 MB of the
bf16 model); |Δlogp| engine (bf16, adapter) vs Megatron (bf16) small on every step; ``final_hf/`` (merged) loads in
transformers and ``final_adapter/`` in PEFT, and the two give the same logits; the checkpoint holds the adapter, not
the weights.

Marked ``gpu``; skipped without CUDA, vLLM for CUDA, megatron-core, Ray, PEFT or the prepared model::

    PYTHONPATH=/tmp/site:$PWD python3 -m pytest tests/gpu/test_lora_megatron_gpu.py -q -s
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
for module in ("vllm", "ray", "megatron.core", "peft"):
    pytest.importorskip(module)

from vime_core.models.prepare import default_cache_dir, is_prepared  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MODEL = default_cache_dir() / "smollm2-135m-instruct"
LOGP_TOL = 0.05  # bf16 engine vs bf16 Megatron (docs/gpu.md: 0.013–0.034 with full weights)
STEPS = 3


@pytest.fixture(scope="module", params=["ipc", "disk"])
def run(request, tmp_path_factory) -> Path:
    if not is_prepared(MODEL):
        pytest.skip(f"{MODEL} is not prepared: vime model prepare smollm2-135m-instruct")
    out = tmp_path_factory.mktemp(f"lora-megatron-{request.param}")
    argv = [
        *("run", "--model", str(MODEL), "--output-dir", str(out), "--trainer", "megatron", "--colocate"),
        *("--actor-num-gpus-per-node", "1", "--weight-sync", request.param, "--megatron-attention", "sdpa"),
        *("--lora-rank", "16", "--lora-alpha", "32", "--target-modules", "all-linear"),
        *("--prompt-data", str(ROOT / "examples/quickstart/data/train.jsonl")),
        *("--reward", "tests.integration.text_reward.text_length_mod3"),
        *("--num-rollout", str(STEPS), "--rollout-batch-size", "8", "--n-samples-per-prompt", "4"),
        *("--rollout-max-response-len", "64", "--rollout-enforce-eager", "--lr", "2e-4"),
        *("--use-kl-loss", "--kl-loss-coef", "0.01", "--save-interval", str(STEPS), "--no-report"),
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1", VLLM_USE_FLASHINFER_SAMPLER="0")
    proc = subprocess.run(
        [sys.executable, "-m", "vime_core.cli", *argv], capture_output=True, text=True, env=env
    )
    print(proc.stdout[-4000:], proc.stderr[-4000:])
    assert proc.returncode == 0, proc.stderr[-8000:]
    for r in _metrics(out):
        print(f"{request.param}: " + ", ".join(f"{k} {r[k]:.4g}" for k in sorted(r) if k.startswith(SHOWN)))
    return out


SHOWN = ("weight_sync/", "train/train_rollout_logprob_abs_diff", "perf/", "memory/")


def _metrics(out: Path) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if "perf/train_time" in line]


def test_only_the_adapter_syncs_and_the_engine_serves_the_trainers_policy(run):
    m = _metrics(run)
    assert len(m) == STEPS
    for r in m:
        assert r["weight_sync/bytes"] < 30e6, r  # the adapter (fp32 over the wire), not 269 MB of weights
        assert r["train/train_rollout_logprob_abs_diff"] < LOGP_TOL, r
        assert r["train/grad_norm"] > 0
    assert [r["weight_sync/version"] for r in m] == list(range(1, STEPS + 1))
    assert (run / "checkpoints" / f"step_{STEPS:06d}" / "trainer" / "adapter" / "adapter_model.safetensors").is_file()
    assert not (run / "checkpoints" / f"step_{STEPS:06d}" / "trainer" / "model.safetensors").exists()


def test_final_hf_is_the_merged_adapter(run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[1, 504, 3458, 314, 260, 1345, 28, 2554]])
    merged = AutoModelForCausalLM.from_pretrained(str(run / "final_hf"), dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(str(MODEL), dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, str(run / "final_adapter"))
    with torch.no_grad():
        a, b = merged(input_ids=ids).logits, adapted(input_ids=ids).logits
    # final_hf is bf16 (Megatron's weights), the adapter fp32 on the fp32 base: equal to bf16 rounding
    assert (a - b).abs().max() < 0.1 * b.abs().max()
