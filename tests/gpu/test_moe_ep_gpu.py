"""Expert parallelism on two GPUs (issue 41): a small Qwen3-MoE (random weights: 16 experts, top-4, hidden 256) on
the megatron trainer at ``--expert-model-parallel-size 2`` against the same step at EP = 1 on one GPU, routing replay
across the EP ranks, and a colocated ``vime run`` at EP = 2 with one vLLM engine per GPU.

* ``test_ep2_step_matches_ep1``: step-1 loss and gradient norm equal within bf16 tolerance; each rank holds half of
  every layer's experts; the weights gathered across EP ranks equal the checkpoint bit for bit; on both ranks every
  router selects exactly the recorded experts (``--use-rollout-routing-replay``; transformers' routes, as an engine
  records them) for every token; seconds per step on the same global batch, EP = 1 on one GPU vs EP = 2 on two, and
  the scaling efficiency (tests/gpu/moe_ep_worker.py under torchrun).
* ``test_vime_run_ep2_with_and_without_replay``: ``vime run --trainer megatron --colocate --weight-sync ipc
  --actor-num-gpus-per-node 2 --expert-model-parallel-size 2`` (two engines, one per GPU), 3 steps, with and without
  ``--use-rollout-routing-replay``: |Δlogp| every step (the experts' weights reach the engines under the right names)
  side by side, and the step time split.

Marked ``gpu``; skipped without two CUDA GPUs (and, for the run, vLLM for CUDA and Ray). With the offline site of
docs/gpu.md on an ``nvidia-h100-x2`` (~1 min for the first test, ~6 min for the runs)::

    PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 python3 -m pytest tests/gpu/test_moe_ep_gpu.py -q -s
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

if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA GPUs", allow_module_level=True)
pytest.importorskip("megatron.core")

ROOT = Path(__file__).resolve().parents[2]
BF16_RTOL = 2e-2


def small_qwen3_moe(out: Path) -> Path:
    """A random Qwen3-MoE of 16 experts (top-4, width 128), hidden 256, 4 layers, the tiny tokenizer's vocabulary."""
    from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from vime_core.testing.tiny_moe import build_tiny_moe

    tiny = build_tiny_moe(out.parent / "tiny", "qwen3_moe")
    tok = AutoTokenizer.from_pretrained(str(tiny))
    config = Qwen3MoeConfig(
        vocab_size=len(tok),
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=16,
        num_experts_per_tok=4,
        norm_topk_prob=True,
        tie_word_embeddings=True,
        initializer_range=0.05,
        max_position_embeddings=2048,
        bos_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).to(torch.bfloat16).save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return small_qwen3_moe(tmp_path_factory.mktemp("ep") / "qwen3_moe")


def test_ep2_step_matches_ep1(model, tmp_path):
    worker = Path(__file__).with_name("moe_ep_worker.py")
    results = {}
    for ep in (1, 2):
        out = tmp_path / f"ep{ep}"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ep)]
        cmd += ["--master-addr", "127.0.0.1", "--master-port", str(29600 + ep), str(worker), str(model), str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-4000:]
        results[ep] = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(ep)]
    for ep, ranks in results.items():
        for r in ranks:
            print(
                f"EP={ep} rank {r['rank']}: {r['local_experts']} local experts in layer 0, weights equal "
                f"{r['weights_equal']}, replayed experts equal {r['replay_equal']}"
            )
            assert r["weights_equal"] and r["replay_equal"] and r["moe_layers"] == [0, 1, 2, 3]
            assert r["local_experts"] == 2 * 16 // ep  # fc1 and fc2 of each local expert
        assert sorted(r["ep_rank"] for r in ranks) == list(range(ep))
    one, two = results[1][0]["metrics"], results[2][0]["metrics"]
    for key in ("train/pg_loss", "train/grad_norm", "train/num_tokens"):
        print(f"{key}: EP=1 {one[key]!r}  EP=2 {two[key]!r}")
    t1, t2 = results[1][0]["step_seconds"], max(r["step_seconds"] for r in results[2])
    print(
        f"seconds per step, same global batch: EP=1 (1 GPU) {t1:.3f}, EP=2 (2 GPUs) {t2:.3f}; scaling efficiency "
        f"{t1 / (2 * t2):.2f}"
    )
    assert two["train/num_tokens"] == one["train/num_tokens"]
    assert two["train/pg_loss"] == pytest.approx(one["train/pg_loss"], rel=BF16_RTOL, abs=1e-3)
    assert two["train/grad_norm"] == pytest.approx(one["train/grad_norm"], rel=0.05)


def _vime_run(model: Path, out: Path, r3: bool) -> list[dict]:
    argv = [
        *("run", "--model", str(model), "--output-dir", str(out), "--trainer", "megatron", "--colocate"),
        *("--actor-num-gpus-per-node", "2", "--expert-model-parallel-size", "2", "--weight-sync", "ipc"),
        *("--rollout-enforce-eager", "--prompt-data", str(ROOT / "examples/quickstart/data/train.jsonl")),
        *("--reward", "tests.integration.text_reward.text_length_mod3"),
        *("--num-rollout", "3", "--rollout-batch-size", "8", "--n-samples-per-prompt", "4"),
        *("--rollout-max-response-len", "48", "--global-batch-size", "32", "--micro-batch-size", "8"),
        *("--lr", "1e-5", "--no-report", "--no-save-hf"),
        *(["--use-rollout-routing-replay"] if r3 else []),
    ]
    log = out.with_suffix(".log")
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


def test_vime_run_ep2_with_and_without_replay(model, tmp_path):
    pytest.importorskip("vllm")
    pytest.importorskip("ray")
    runs = {r3: _vime_run(model, tmp_path / f"r3_{r3}", r3) for r3 in (False, True)}
    key = "train/train_rollout_logprob_abs_diff"
    print("step  |Δlogp| EP=2  |Δlogp| EP=2 + R3  train s  rollout s  sync s")
    for plain, replay in zip(runs[False], runs[True], strict=True):
        print(
            f"{plain['step']:4d}  {plain[key]:12.5f}  {replay[key]:17.5f}  {replay['perf/train_time']:7.2f}  "
            f"{replay['perf/rollout_time']:9.2f}  {replay['perf/sync_time']:6.3f}"
        )
    for metrics in runs.values():
        assert [m["step"] for m in metrics] == [0, 1, 2]
        assert all(m[key] < 0.1 and m["train/grad_norm"] > 0 for m in metrics)
