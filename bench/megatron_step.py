"""Megatron backend on one GPU: a ~1B Llama-shaped model trained with vime's RL loss; step time and MFU.

Builds a random Llama-shaped HF checkpoint (default: hidden 2048, 16 layers, 16 heads, FFN 5632, vocab 32000,
untied: 0.95B parameters, bf16), loads it into ``--trainer megatron`` and reports:

* the measured bf16 matmul peak of this GPU (8192³ products, mean of 10 after 3 warm-ups), TFLOP/s;
* HF → Megatron → HF round trip of the 1B checkpoint (bit-exact or not);
* max |log-prob| difference of Megatron (bf16) and Hugging Face (bf16 and fp32) on one 512-token sequence;
* per ``--attention`` choice: seconds per RL training step (forward + backward + distributed-optimizer step, the
  PPO-clip policy loss on ``--batch`` × ``--seq`` tokens, half prompt / half response), tokens/s, model TFLOP/s by
  ``6·N·tokens`` and with causal attention (``+ 6·L·s·h`` per token), and MFU = model FLOP/s / measured peak.

On the lent H200 (no package index there), with megatron-core carried as a wheel in ``.whl/``::

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/megatron_core-*.whl
    PYTHONPATH=/tmp/site:. python3 bench/megatron_step.py [--steps 5] [--attention sdpa,local]

The shapes of a step inside ``vime run`` (``bench/gpu_loop.py`` runs this as its ``bench_train`` section)::

    python3 bench/megatron_step.py --model /tmp/llama-1b --batch 8,16 --prompt-len 100 --seq 1124 \
        --attention sdpa --qkv-format bshd,thd --empty-cache --skip-checks --json out.json [--profile]

``--model`` trains an existing HF checkpoint (its parameter count in the MFU); ``--prompt-len`` sets the prompt part
of each ``--seq``-token sample; ``--empty-cache`` returns the allocator's cache to the GPU after every step, as the
colocated loop does for the sleeping engine; ``--qkv-format`` the micro-batch layout; ``--profile`` prints the
operators that took the most GPU time in one step. Each step's split (forward, backward, optimizer, ...) is the
trainer's own ``perf/train_*_time``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from vime_core.config import RunConfig


def matmul_peak_tflops(n: int = 8192, iters: int = 10) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * iters / (time.perf_counter() - t0) / 1e12


def build_model(out: Path, a: argparse.Namespace) -> Path:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        intermediate_size=a.ffn,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        max_position_embeddings=max(4096, a.seq),
        tie_word_embeddings=False,
        rope_theta=500000.0,
        initializer_range=0.02,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True)
    del model
    return out


def rl_batch(vocab: int, n: int, seq: int, seed: int, prompt_len: int | None = None):
    from vime_core.types import RolloutBatch, Sample, Status

    g = torch.Generator().manual_seed(seed)
    prompt = seq // 2 if prompt_len is None else prompt_len
    resp = seq - prompt
    samples, advs = [], []
    for i in range(n):
        s = Sample(
            group_index=i // 4,
            index=i,
            tokens=torch.randint(0, vocab, (prompt,), generator=g).tolist(),
            status=Status.COMPLETED,
            reward=float(i % 2),
        )
        s.append_response_tokens(
            torch.randint(0, vocab, (resp,), generator=g).tolist(),
            trainable=True,
            log_probs=[-10.0] * resp,
            weight_version=0,
        )
        samples.append(s)
        advs.append([1.0 if i % 2 else -1.0] * resp)
    return RolloutBatch(samples=samples, advantages=advs)


def trainer_run_config(a: argparse.Namespace, attention: str, qkv_format: str = "bshd") -> RunConfig:
    """The trainer's typed configuration for this bench (``a``: the bench's own command line)."""
    from vime_core.testing.trainer_args import trainer_config

    return trainer_config(
        lr=1e-6,
        micro_batch_size=a.micro_batch,
        megatron_attention=attention,
        recompute_granularity=None,
        qkv_format=qkv_format,
        fp32_lm_head=not a.bf16_lm_head,
    )


def profile_step(trainer, batch, rows: int = 25) -> str:
    """One training step under ``torch.profiler``: the ``rows`` operators with the most GPU time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        trainer.train_step(batch)
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=16)
    ap.add_argument("--ffn", type=int, default=5632)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", default="8", help="samples per step; a comma list runs each")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--attention", default="sdpa,local")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--model", type=Path, default=None, help="an HF checkpoint to train instead of a built one")
    ap.add_argument("--prompt-len", type=int, default=None, help="prompt tokens of each sample (default: seq / 2)")
    ap.add_argument("--qkv-format", default="bshd", help="bshd, thd or both (comma list)")
    ap.add_argument("--empty-cache", action="store_true", help="torch.cuda.empty_cache() after every step")
    ap.add_argument("--bf16-lm-head", action="store_true", help="the LM head's logits rounded to bf16 (as before)")
    ap.add_argument("--skip-checks", action="store_true", help="no round trip, no comparison with HF")
    ap.add_argument("--profile", action="store_true", help="print the top GPU operators of one step")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    a = ap.parse_args()
    from safetensors.torch import load_file

    from vime_core.algorithms.logprobs import token_log_probs
    from vime_core.trainer.megatron_backend import MegatronTrainer

    res: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    try:
        import megatron.core

        res["megatron_core"] = megatron.core.__version__
    except Exception:  # noqa: BLE001
        pass
    res["peak_bf16_tflops"] = matmul_peak_tflops()
    print(
        f"GPU {res['gpu']}, torch {res['torch']}, megatron-core {res.get('megatron_core')}; "
        f"measured bf16 matmul peak {res['peak_bf16_tflops']:.0f} TFLOP/s",
        flush=True,
    )

    if a.model is not None:
        model_dir = a.model
        from transformers import AutoConfig

        hf_cfg = AutoConfig.from_pretrained(str(model_dir))
        a.vocab, a.layers, a.hidden = hf_cfg.vocab_size, hf_cfg.num_hidden_layers, hf_cfg.hidden_size
    else:
        work = Path(tempfile.mkdtemp(prefix="vime-meg-"))
        t0 = time.perf_counter()
        model_dir = build_model(work / "llama-1b", a)
        print(f"built HF checkpoint in {time.perf_counter() - t0:.1f} s", flush=True)
    hf = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        hf.update(load_file(str(f)))
    n_params = sum(t.numel() for t in hf.values())
    res["params"] = n_params
    if a.skip_checks:
        hf = {}

    variants = [(att, fmt) for att in a.attention.split(",") for fmt in a.qkv_format.split(",")]
    for i, (attention, fmt) in enumerate(variants):
        t0 = time.perf_counter()
        trainer = MegatronTrainer(trainer_run_config(a, attention, fmt), model_dir)
        name = attention if fmt == "bshd" else f"{attention}-{fmt}"
        print(
            f"[{name}] MegatronTrainer ready in {time.perf_counter() - t0:.1f} s "
            f"(spec: {'TE' if attention == 'te' else 'local'}, attention {attention}, qkv-format {fmt})",
            flush=True,
        )
        if i == 0 and not a.skip_checks:
            exported = dict(trainer.named_hf_tensors())
            exact = sorted(exported) == sorted(hf) and all(
                torch.equal(exported[k].view(torch.uint8), hf[k].view(torch.uint8)) for k in hf
            )
            res["round_trip_bit_exact"] = exact
            print(
                f"HF -> Megatron -> HF round trip of {len(hf)} tensors ({n_params / 1e9:.3f} B params): "
                f"bit-exact = {exact}",
                flush=True,
            )
            del exported
            from transformers import AutoModelForCausalLM

            ids = torch.randint(0, a.vocab, (1, 512), generator=torch.Generator().manual_seed(1))
            meg = token_log_probs(trainer.model(input_ids=ids).logits, ids)
            with torch.no_grad():
                ref_model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).cuda().eval()
                ref = token_log_probs(ref_model(input_ids=ids.cuda()).logits.float().cpu(), ids)
                ref_model.to(torch.bfloat16)
                hf16 = token_log_probs(ref_model(input_ids=ids.cuda()).logits.float().cpu(), ids)
            del ref_model
            res["logprob_maxdiff_megatron_vs_hf_fp32"] = (meg - ref).abs().max().item()
            res["logprob_maxdiff_hf_bf16_vs_hf_fp32"] = (hf16 - ref).abs().max().item()
            res["logprob_maxdiff_megatron_vs_hf_bf16"] = (meg - hf16).abs().max().item()
            print(
                "max |log-prob diff| on 511 tokens: megatron-bf16 vs HF-fp32 "
                f"{res['logprob_maxdiff_megatron_vs_hf_fp32']:.4f}, HF-bf16 vs HF-fp32 "
                f"{res['logprob_maxdiff_hf_bf16_vs_hf_fp32']:.4f}, megatron-bf16 vs HF-bf16 "
                f"{res['logprob_maxdiff_megatron_vs_hf_bf16']:.4f}",
                flush=True,
            )
        for batch_size in (int(b) for b in a.batch.split(",")):
            res[f"train_{name}_{batch_size}x{a.seq}"] = r = measure_steps(trainer, a, name, batch_size, n_params, res)
            if len(a.batch.split(",")) == 1:
                res[f"train_{name}"] = r  # the key of earlier runs
        del trainer
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    print("RESULT " + json.dumps(res))
    if a.out:
        Path(a.out, "megatron_step.json").write_text(json.dumps(res, indent=1))
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))


def measure_steps(trainer, a: argparse.Namespace, name: str, batch_size: int, n_params: int, res: dict) -> dict:
    """``a.warmup + a.steps`` training steps of ``batch_size`` samples of ``a.seq`` tokens: median step time, MFU
    (6·N·tokens, and with causal attention), tokens/s, peak memory and the median of the trainer's own split."""
    times, splits, metrics = [], [], {}
    for step in range(a.warmup + a.steps):
        batch = rl_batch(a.vocab, batch_size, a.seq, seed=step, prompt_len=a.prompt_len)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        metrics = trainer.train_step(batch)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if a.empty_cache:  # as the colocated loop does for the engine that wakes next (not timed: its own figure)
            t1 = time.perf_counter()
            torch.cuda.empty_cache()
            metrics["perf/empty_cache_time"] = time.perf_counter() - t1
        if step >= a.warmup:
            times.append(dt)
            splits.append({k: v for k, v in metrics.items() if k.startswith("perf/")})
        print(
            f"[{name}] {batch_size}x{a.seq} step {step}: {dt:.3f} s, pg_loss {metrics.get('train/pg_loss', 0):.4f}, "
            f"grad_norm {metrics['train/grad_norm']:.3f}",
            flush=True,
        )
    step_s = statistics.median(times)
    tokens = batch_size * a.seq
    flops_6nt = 6 * n_params * tokens
    flops_attn = flops_6nt + 6 * a.layers * a.seq * a.hidden * tokens  # causal QK^T + AV, fwd + bwd
    r = {
        "step_s_median": step_s,
        "step_s_all": times,
        "tokens_per_s": tokens / step_s,
        "tflops_6nt": flops_6nt / step_s / 1e12,
        "tflops_with_attention": flops_attn / step_s / 1e12,
        "max_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
        "split": {k: statistics.median(s.get(k, 0.0) for s in splits) for k in sorted({k for s in splits for k in s})},
    }
    r["mfu_6nt"] = r["tflops_6nt"] / res["peak_bf16_tflops"]
    r["mfu_with_attention"] = r["tflops_with_attention"] / res["peak_bf16_tflops"]
    split = ", ".join(f"{k.removeprefix('perf/')} {v:.3f}" for k, v in r["split"].items())
    print(
        f"[{name}] {n_params / 1e9:.3f} B params, batch {batch_size}x{a.seq} tokens: median step "
        f"{step_s:.3f} s, {r['tokens_per_s']:.0f} tok/s, {r['tflops_6nt']:.0f} TFLOP/s (6NT) = MFU "
        f"{r['mfu_6nt']:.1%}; with attention FLOPs {r['tflops_with_attention']:.0f} TFLOP/s = "
        f"{r['mfu_with_attention']:.1%}; peak memory {r['max_memory_gib']:.1f} GiB; split: {split}",
        flush=True,
    )
    if a.profile:
        batch = rl_batch(a.vocab, batch_size, a.seq, seed=99, prompt_len=a.prompt_len)
        print(f"[{name}] {batch_size}x{a.seq} profile of one step:\n{profile_step(trainer, batch)}", flush=True)
    torch.cuda.reset_peak_memory_stats()
    return r


if __name__ == "__main__":
    main()
