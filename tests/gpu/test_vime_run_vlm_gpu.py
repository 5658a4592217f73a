"""``vime run`` of examples/geo3k_vlm on one GPU: the torch trainer (fp32) colocated with a bf16 CUDA vLLM engine
serving the tiny random Qwen2.5-VL (vime_core/testing/tiny_vlm.py, built here), vLLM's sleep mode between rollout
and training, ``ipc`` weight sync (the vision tower included: it trains).

Checked, on every one of the 3 steps: exit 0; each sample's figure in the dump, its image placeholder runs as long as
the processor makes them, no image token among the response tokens and every response token in the loss mask; the
per-token weight versions = the step; |Δlogp| (engine bf16 vs trainer fp32, token mean) below :data:`LOGP_TOL`
(printed with the maximum per token recomputed from the dump at step 0); the GPU memory the sleeping engine frees
(``colocate/free_gib_*``: ``torch.cuda.mem_get_info`` in the trainer rank) and takes back when woken.

vLLM 0.24 (the GPU machine's release) takes the images through ``/v1/chat/completions/render`` features
(docs/vlm.md). Marked ``gpu``; skipped without CUDA, vLLM for CUDA, Ray or torchvision. On the GPU machine::

    PYTHONPATH=/tmp/site:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 python3 -m pytest tests/gpu/test_vime_run_vlm_gpu.py -q -s

(about 3 minutes: the engine start dominates).
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
pytest.importorskip("vllm")
pytest.importorskip("ray")
pytest.importorskip("torchvision")

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
#: bf16 engine vs fp32 trainer, mean |Δlogp| over the trained tokens: a bound for "the engine serves the trainer's
#: weights and sees the same image", not the accuracy target (a wrong image or stale weights are off by ~1 or more)
LOGP_TOL = 0.05


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, Path]:
    from vime_core.testing.tiny_vlm import build_tiny_vlm

    root = tmp_path_factory.mktemp("vlm-gpu")
    model = build_tiny_vlm(root / "tiny-qwen2.5-vl")
    out = root / "out"
    argv = [
        *("run", "--config", str(ROOT / "examples/geo3k_vlm/config.yaml"), "--model", str(model)),
        *("--output-dir", str(out), "--num-rollout", str(STEPS)),
        *("--trainer", "torch", "--train-device", "cuda", "--colocate", "--actor-num-gpus-per-node", "1"),
        *("--weight-sync", "ipc", "--rollout-enforce-eager", "--no-report"),
        *("--save-debug-rollout-data", str(out / "debug" / "r_{rollout_id}.pt")),
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    log = root / "run.log"
    with open(log, "w") as f:
        rc = subprocess.run(
            [sys.executable, "-m", "vime_core.cli", *argv],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
            timeout=900,
        ).returncode
    text = log.read_text()
    print(f"--- vime run (exit {rc}), last lines:\n{text[-4000:]}")
    assert rc == 0, text[-8000:]
    return out, model


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_every_step_trains_syncs_and_the_engine_serves_the_trainers_weights(run):
    out, _ = run
    m = _metrics(out)
    assert [r["step"] for r in m] == list(range(STEPS))
    for r in m:
        print(
            f"step {r['step']}: |Δlogp| {r['train/train_rollout_logprob_abs_diff']:.5f} "
            f"grad_norm {r['train/grad_norm']:.4f} rollout {r['perf/rollout_time']:.2f}s "
            f"train {r['perf/train_time']:.2f}s sync {r['perf/sync_time']:.3f}s "
            f"sync bytes {r['weight_sync/bytes']:.0f} "
            f"free GiB awake/asleep/woken {r['colocate/free_gib_awake']:.1f}/{r['colocate/free_gib_asleep']:.1f}/"
            f"{r['colocate/free_gib_woken']:.1f}"
        )
        assert r["train/train_rollout_logprob_abs_diff"] < LOGP_TOL
        assert r["train/grad_norm"] > 0 and r["weight_sync/bytes"] > 0
        assert r["weight_sync/version"] == r["step"] + 1


def test_sleep_frees_the_engines_memory_and_wake_takes_it_back(run):
    out, _ = run
    for r in _metrics(out):
        freed = r["colocate/free_gib_asleep"] - r["colocate/free_gib_awake"]
        assert freed > 1.0, r  # the engine's KV cache (its weights are a few MB)
        assert abs(r["colocate/free_gib_woken"] - r["colocate/free_gib_awake"]) < 1.0, r


def test_images_masks_and_versions_in_every_step(run):
    from vime_core.data.vision_prompt import image_runs, image_token_counts, image_token_id, load_processor
    from vime_core.run.debug_rollout import load_debug_rollout
    from vime_core.trainer.torch_backend import response_log_probs
    from vime_core.trainer.vision import load_hf_model

    out, model_dir = run
    processor = load_processor(str(model_dir))
    pad = image_token_id(processor)
    policy = load_hf_model(model_dir, torch.float32).eval()
    worst = 0.0
    for step in range(STEPS):
        samples = [s for g in load_debug_rollout(str(out / "debug" / "r_{rollout_id}.pt"), step) for s in g]
        assert len(samples) == 16
        for s in samples:
            assert len(s.images) == 1
            assert [n for _, n in image_runs(s.tokens[: s.prompt_length], pad)] == image_token_counts(
                processor, s.images
            )
            assert pad not in s.tokens[s.prompt_length :]
            assert s.loss_mask == [1] * s.response_length
            assert s.weight_versions == [step] * s.response_length
            if step == 0:  # the engine served the initial weights: the per-token gap against them
                with torch.no_grad():
                    lp = response_log_probs(policy, [s], torch.device("cpu"))[0][0]
                worst = max(worst, (lp - torch.tensor(s.rollout_log_probs)).abs().max().item())
    print(f"step 0: max |Δlogp| per token (bf16 engine vs fp32 trainer) {worst:.4f}")
    assert worst < 10 * LOGP_TOL
