"""The megatron trainer's model families on a GPU: Qwen3 (tied and untied) and a Llama-3.2-shaped Llama (llama3 RoPE
scaling).

* Parity: per family, a small random model (hidden 256, 3 layers, 8 heads / 2 KV heads, vocabulary 1000; Qwen3 with
  head_dim 64 ≠ 256 / 8 and q/k norms; the Llama with Llama-3.2's RoPE: base 500000, llama3 factor 32, original
  context 8192) loaded into the ``megatron`` trainer (bf16, local spec): the HF export (what vLLM loads) equals the
  checkpoint bit for bit, and the max |log-prob| difference to transformers fp32 is printed beside transformers
  bf16's and bounded as tests/gpu/test_megatron_backend.py bounds it. The Llama runs 8,448 tokens, past the original
  context, and prints the difference beyond position 8192 separately.
* ``vime run --trainer megatron --colocate --weight-sync ipc``, 3 steps, per family with the tiny models of
  vime_core/testing/tiny_model.py (their own tokenizer and chat template) and a CUDA vLLM engine: exit 0, non-empty
  responses whose rewards come from their text (``len(response) % 3``), and |Δlogp| (engine vs trainer, bf16) below
  :data:`LOGP_TOL` on every step.

Marked ``gpu``; skipped without CUDA or megatron-core (the runs also without vLLM or Ray). On the GPU machine with
the offline site of docs/gpu.md on ``PYTHONPATH`` (and ``VLLM_USE_FLASHINFER_SAMPLER=0``)::

    PYTHONPATH=/tmp/site:$PWD python3 -m pytest tests/gpu/test_model_families_gpu.py -q -s
"""

from __future__ import annotations

import importlib.util
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
pytest.importorskip("megatron.core")

ROOT = Path(__file__).resolve().parents[2]
#: bf16 engine vs bf16 Megatron trainer, mean |Δlogp| over the trained tokens (as tests/gpu/test_vime_run_gpu.py)
LOGP_TOL = 0.05
STEPS = 3
LLAMA32_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def build_family(out: Path, family: str, seed: int = 0) -> Path:
    """A small random HF checkpoint of ``family`` in bf16 (see the module docstring)."""
    import transformers

    torch.manual_seed(seed)
    common = dict(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        initializer_range=0.1,
    )
    if family.startswith("qwen3"):
        config = transformers.Qwen3Config(
            **common,
            head_dim=64,
            tie_word_embeddings=family == "qwen3",
            rope_theta=1000000.0,
            max_position_embeddings=4096,
        )
        model = transformers.Qwen3ForCausalLM(config)
    else:
        config = transformers.LlamaConfig(
            **common,
            tie_word_embeddings=True,
            rope_theta=500000.0,
            rope_scaling=dict(LLAMA32_ROPE),
            max_position_embeddings=131072,
        )
        model = transformers.LlamaForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(str(out), safe_serialization=True)
    return out


@pytest.mark.parametrize("family", ["qwen3", "qwen3-untied", "llama3.2"])
def test_export_is_bit_exact_and_log_probs_match_transformers(family, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from vime_core.algorithms.logprobs import token_log_probs
    from vime_core.testing.trainer_args import trainer_config
    from vime_core.trainer.megatron_backend import MegatronTrainer

    model_dir = build_family(tmp_path / family, family)
    trainer = MegatronTrainer(trainer_config(lr=1e-3), model_dir)
    assert trainer.arch.qk_layernorm == family.startswith("qwen3")
    original = load_file(str(model_dir / "model.safetensors"))
    if trainer.arch.tie_word_embeddings:
        original.pop("lm_head.weight", None)
    exported = dict(trainer.named_hf_tensors())
    assert sorted(exported) == sorted(original)
    for name, t in original.items():
        assert torch.equal(exported[name].view(torch.uint8), t.view(torch.uint8)), name
    seq = 8448 if family == "llama3.2" else 512  # the Llama past llama3's original context of 8192
    ids = torch.randint(0, 1000, (1, seq), generator=torch.Generator().manual_seed(3))
    meg = token_log_probs(trainer.model(input_ids=ids).logits, ids)
    del trainer
    torch.cuda.empty_cache()
    with torch.no_grad():
        hf32 = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).cuda().eval()
        ref = token_log_probs(hf32(input_ids=ids.cuda()).logits.float().cpu(), ids)
        hf16 = hf32.to(torch.bfloat16)
        hf_bf16 = token_log_probs(hf16(input_ids=ids.cuda()).logits.float().cpu(), ids)
    meg_err, hf_err = (meg - ref).abs().max().item(), (hf_bf16 - ref).abs().max().item()
    line = f"\n{family}: max |logprob - fp32 HF| over {seq} tokens: megatron bf16 {meg_err:.4f}, HF bf16 {hf_err:.4f}"
    if family == "llama3.2":
        past = (meg - ref)[:, 8191:].abs().max().item()
        line += f"; past position 8192: megatron bf16 {past:.4f}, HF bf16 {(hf_bf16 - ref)[:, 8191:].abs().max():.4f}"
    print(line + f"; mean {(meg - ref).abs().mean().item():.5f} vs {(hf_bf16 - ref).abs().mean().item():.5f}")
    assert meg_err < max(3 * hf_err, 0.05)


def _vime_run(model: Path, out: Path) -> subprocess.CompletedProcess:
    argv = [
        *("run", "--model", str(model), "--output-dir", str(out), "--trainer", "megatron", "--colocate"),
        *("--actor-num-gpus-per-node", "1", "--weight-sync", "ipc", "--rollout-enforce-eager"),
        *("--prompt-data", str(ROOT / "examples/quickstart/data/train.jsonl")),
        *("--reward", "tests.integration.text_reward.text_length_mod3"),
        *("--num-rollout", str(STEPS), "--rollout-batch-size", "4", "--n-samples-per-prompt", "4"),
        *("--rollout-max-response-len", "32", "--rollout-temperature", "1.0", "--vllm-max-model-len", "2048"),
        *("--global-batch-size", "16", "--micro-batch-size", "8", "--lr", "1e-5"),
        *("--save-debug-rollout-data", str(out / "debug" / "r_{rollout_id}.pt"), "--no-report", "--no-save-hf"),
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, "-m", "vime_core.cli", *argv],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=900,
    )


@pytest.mark.skipif(
    not all(importlib.util.find_spec(m) for m in ("vllm", "ray")), reason="needs vLLM for CUDA and Ray"
)
@pytest.mark.parametrize("family", ["qwen3", "llama3.2"])
def test_vime_run_megatron_colocated_ipc_three_steps(family, tmp_path):
    from transformers import AutoTokenizer

    from vime_core.run.debug_rollout import load_debug_rollout
    from vime_core.testing.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / f"tiny-{family}", seed=0, family=family)
    out = tmp_path / "out"
    proc = _vime_run(model, out)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    tok = AutoTokenizer.from_pretrained(str(model))
    for step in range(STEPS):
        samples = [s for g in load_debug_rollout(str(out / "debug" / "r_{rollout_id}.pt"), step) for s in g]
        assert len(samples) == 16
        for s in samples:
            assert s.status.value in ("completed", "truncated"), s.metadata.get("error")
            response_ids = s.tokens[len(s.tokens) - s.response_length :]
            assert s.response_length > 0 and s.response.strip()
            assert s.response == tok.decode(response_ids, skip_special_tokens=True)
            assert s.reward == float(len(s.response) % 3)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(STEPS))
    for m in metrics:
        print(
            f"{family} step {m['step']}: |Δlogp| {m['train/train_rollout_logprob_abs_diff']:.5f} grad_norm "
            f"{m['train/grad_norm']:.4f} rollout {m['perf/rollout_time']:.2f}s train {m['perf/train_time']:.2f}s "
            f"sync {m['perf/sync_time']:.3f}s"
        )
        assert m["train/train_rollout_logprob_abs_diff"] < LOGP_TOL
        assert m["train/grad_norm"] > 0 and m["weight_sync/bytes"] > 0
