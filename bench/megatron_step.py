"""Megatron backend on one GPU: model shapes of each family trained with vime's RL loss; step time and MFU.

Builds a random HF checkpoint per ``--shapes`` entry (bf16) and loads it into ``--trainer megatron``:

* ``llama-0.95b`` (default): Llama-shaped, hidden 2048, 16 layers, 16 heads, FFN 5632, vocab 32000, untied: 0.95B
  parameters (``--hidden`` / ``--layers`` / ... change it);
* ``qwen3-0.6b``: Qwen3-0.6B's shape: 28 layers, hidden 1024, 16 heads / 8 KV heads of head_dim 128, q/k norms,
  FFN 3072, vocab 151936, tied;
* ``qwen3-moe-small``: a small Qwen3-MoE (8 layers, hidden 1024, 16 heads / 4 KV heads of 128, 32 experts of FFN 768,
  top-4, vocab 151936, untied); MFU counts the active parameters. Needs the MoE family on the megatron trainer
  (until it is there the shape is reported as skipped, with the trainer's error).

For each it reports:

* the measured bf16 matmul peak of this GPU (8192³ products, mean of 10 after 3 warm-ups), TFLOP/s;
* HF → Megatron → HF round trip of the 1B checkpoint (bit-exact or not);
* max |log-prob| difference of Megatron (bf16) and Hugging Face (bf16 and fp32) on one 512-token sequence;
* per ``--attention`` choice: seconds per RL training step (forward + backward + distributed-optimizer step, the
  PPO-clip policy loss on ``--batch`` × ``--seq`` tokens, half prompt / half response), tokens/s, model TFLOP/s by
  ``6·N·tokens`` (N: every parameter, a tied embedding once; MoE: the active ones) and with causal attention
  (``+ 6·L·s·nh·d`` per token), and MFU = model FLOP/s / measured peak;
* at the end one line per shape and attention: MFU side by side.

On the lent H200 (no package index there), with megatron-core carried as a wheel in ``.whl/``::

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/megatron_core-*.whl
    PYTHONPATH=/tmp/site:. python3 bench/megatron_step.py [--steps 5] [--attention sdpa,local] \
        [--shapes llama-0.95b,qwen3-0.6b,qwen3-moe-small]

The shapes of a step inside ``vime run`` (``bench/gpu_loop.py`` runs this as its ``bench_train`` section)::

    python3 bench/megatron_step.py --model /tmp/llama-1b --batch 8,16 --prompt-len 100 --seq 1124 \
        --attention sdpa --qkv-format bshd,thd --empty-cache --skip-checks --json out.json [--profile]

``--model`` trains an existing HF checkpoint instead of ``--shapes`` (its parameter count in the MFU);
``--prompt-len`` sets the prompt part of each ``--seq``-token sample; ``--empty-cache`` returns the allocator's
cache to the GPU after every step, as the colocated loop does for the sleeping engine; ``--qkv-format`` the
micro-batch layout; ``--profile`` prints the operators that took the most GPU time in one step; ``--in-ray`` runs
it all in a Ray worker placed as vime places a trainer rank (what the Ray process costs the step);
``--idle-between-steps S`` sleeps ``S`` seconds before each step, as the loop's trainer idles through a rollout.
Each step's split (forward, backward, optimizer, ...) is the trainer's own ``perf/train_*_time``.
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


#: the HF config of each ``--shapes`` preset other than ``llama-0.95b`` (whose sizes are the command line's)
SHAPES: dict[str, tuple[str, str, dict]] = {
    "qwen3-0.6b": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(
            vocab_size=151936,
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            tie_word_embeddings=True,
            rope_theta=1000000.0,
            max_position_embeddings=40960,
        ),
    ),
    "qwen3-moe-small": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            vocab_size=151936,
            hidden_size=1024,
            intermediate_size=3072,
            moe_intermediate_size=768,
            num_experts=32,
            num_experts_per_tok=4,
            norm_topk_prob=True,
            num_hidden_layers=8,
            num_attention_heads=16,
            num_key_value_heads=4,
            head_dim=128,
            tie_word_embeddings=False,
            rope_theta=1000000.0,
            max_position_embeddings=40960,
        ),
    ),
}


def build_model(out: Path, a: argparse.Namespace, shape: str = "llama-0.95b") -> Path:
    import transformers

    if shape == "llama-0.95b":
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
        model_cls = transformers.LlamaForCausalLM
    else:
        config_cls, model_name, fields = SHAPES[shape]
        config = getattr(transformers, config_cls)(**fields, initializer_range=0.02)
        model_cls = getattr(transformers, model_name)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = model_cls(config).to(torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True)
    del model
    return out


def shape_sizes(model_dir: Path, hf: dict[str, torch.Tensor]) -> dict[str, int]:
    """``params`` (all stored tensors), ``active_params`` (MoE: expert tensors × top-k / experts), ``layers``,
    ``attention_width`` (heads × head_dim) and ``vocab`` of a checkpoint."""
    config = json.loads((model_dir / "config.json").read_text())
    params = sum(t.numel() for t in hf.values())
    experts = sum(t.numel() for k, t in hf.items() if ".mlp.experts." in k)
    active = params - experts
    if experts:
        active += experts * config["num_experts_per_tok"] // config["num_experts"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return {
        "params": params,
        "active_params": active,
        "layers": config["num_hidden_layers"],
        "attention_width": config["num_attention_heads"] * head_dim,
        "vocab": config["vocab_size"],
    }


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


def bench_shape(a: argparse.Namespace, shape: str, model_dir: Path, peak: float, summary: list[str]) -> dict:
    """Check ``model_dir``'s round trip and log-probs (unless ``--skip-checks``), time ``--steps`` RL steps per
    ``--attention`` × ``--qkv-format`` × ``--batch``; appends one MFU line per variant to ``summary`` and returns the
    figures."""
    from safetensors.torch import load_file

    from vime_core.algorithms.logprobs import token_log_probs
    from vime_core.trainer.megatron_backend import MegatronTrainer
    from vime_core.trainer.megatron_convert import ConversionError

    res: dict = {}
    hf = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        hf.update(load_file(str(f)))
    sizes = shape_sizes(model_dir, hf)
    res.update(sizes)
    n_params = sizes["params"]
    vocab = sizes["vocab"]
    if a.skip_checks:
        hf = {}

    variants = [(att, fmt) for att in a.attention.split(",") for fmt in a.qkv_format.split(",")]
    for i, (attention, fmt) in enumerate(variants):
        t0 = time.perf_counter()
        try:
            trainer = MegatronTrainer(trainer_run_config(a, attention, fmt), model_dir)
        except ConversionError as e:  # a family the megatron trainer does not build
            res["skipped"] = str(e)
            summary.append(f"[{shape}] skipped: the megatron trainer does not build it ({e})")
            print(summary[-1], flush=True)
            return res
        name = attention if fmt == "bshd" else f"{attention}-{fmt}"
        print(
            f"[{shape} {name}] MegatronTrainer ready in {time.perf_counter() - t0:.1f} s "
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
                f"[{shape}] HF -> Megatron -> HF round trip of {len(hf)} tensors ({n_params / 1e9:.3f} B params): "
                f"bit-exact = {exact}",
                flush=True,
            )
            del exported
            from transformers import AutoModelForCausalLM

            ids = torch.randint(0, vocab, (1, 512), generator=torch.Generator().manual_seed(1))
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
                f"[{shape}] max |log-prob diff| on 511 tokens: megatron-bf16 vs HF-fp32 "
                f"{res['logprob_maxdiff_megatron_vs_hf_fp32']:.4f}, HF-bf16 vs HF-fp32 "
                f"{res['logprob_maxdiff_hf_bf16_vs_hf_fp32']:.4f}, megatron-bf16 vs HF-bf16 "
                f"{res['logprob_maxdiff_megatron_vs_hf_bf16']:.4f}",
                flush=True,
            )
        batches = [int(b) for b in a.batch.split(",")]
        for batch_size in batches:
            r = measure_steps(trainer, a, f"{shape} {name}", batch_size, sizes, peak)
            res[f"train_{name}_{batch_size}x{a.seq}"] = r
            if len(batches) == 1:
                res[f"train_{name}"] = r  # the key of earlier runs
            summary.append(
                f"MFU {shape:16s} [{name}]: {r['mfu_6nt']:.1%} (6NT), {r['mfu_with_attention']:.1%} with attention; "
                f"{r['step_s_median']:.3f} s/step, {r['tokens_per_s']:.0f} tok/s at {batch_size}x{a.seq}"
            )
        del trainer
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return res


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
    ap.add_argument(
        "--shapes", default="llama-0.95b", help=f"comma-separated: llama-0.95b, {', '.join(SHAPES)} (module doc)"
    )
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--model", type=Path, default=None, help="an HF checkpoint to train instead of a built one")
    ap.add_argument("--prompt-len", type=int, default=None, help="prompt tokens of each sample (default: seq / 2)")
    ap.add_argument("--qkv-format", default="bshd", help="bshd, thd or both (comma list)")
    ap.add_argument("--empty-cache", action="store_true", help="torch.cuda.empty_cache() after every step")
    ap.add_argument("--bf16-lm-head", action="store_true", help="the LM head's logits rounded to bf16 (as before)")
    ap.add_argument("--skip-checks", action="store_true", help="no round trip, no comparison with HF")
    ap.add_argument("--profile", action="store_true", help="print the top GPU operators of one step")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument(
        "--idle-between-steps",
        type=float,
        default=0.0,
        help="seconds this process sleeps before each step, as the loop's trainer waits through the rollout and sync",
    )
    ap.add_argument(
        "--in-ray",
        action="store_true",
        help="run the bench inside a Ray task placed as vime places a trainer rank (num_gpus=1, num_cpus=0)",
    )
    a = ap.parse_args()
    if a.in_ray:
        import ray

        ray.init(num_gpus=1, include_dashboard=False, log_to_driver=True)
        try:
            ray.get(ray.remote(num_gpus=1, num_cpus=0)(run).remote(a))
        finally:
            ray.shutdown()
    else:
        run(a)


def run(a: argparse.Namespace) -> None:
    """The bench for the parsed command line ``a`` (in this process, or in a Ray worker with ``--in-ray``)."""
    res: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "in_ray": a.in_ray}
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

    summary: list[str] = []
    if a.model is not None:  # an existing checkpoint: its figures at the top level (bench/gpu_loop.py reads them)
        res.update(bench_shape(a, a.model.name, a.model, res["peak_bf16_tflops"], summary))
    else:
        work = Path(tempfile.mkdtemp(prefix="vime-meg-"))
        for shape in a.shapes.split(","):
            t0 = time.perf_counter()
            model_dir = build_model(work / shape, a, shape)
            print(f"[{shape}] built HF checkpoint in {time.perf_counter() - t0:.1f} s", flush=True)
            res[shape] = bench_shape(a, shape, model_dir, res["peak_bf16_tflops"], summary)
            gc.collect()
            torch.cuda.empty_cache()
    for line in summary:
        print(line, flush=True)
    print("RESULT " + json.dumps(res))
    if a.out:
        Path(a.out, "megatron_step.json").write_text(json.dumps(res, indent=1))
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))


def measure_steps(trainer, a: argparse.Namespace, name: str, batch_size: int, sizes: dict, peak: float) -> dict:
    """``a.warmup + a.steps`` training steps of ``batch_size`` samples of ``a.seq`` tokens: median step time, MFU
    (6·N·tokens with N the active parameters, and with causal attention) against ``peak`` TFLOP/s, tokens/s, peak
    memory and the median of the trainer's own split (``perf/train_*_time``)."""
    from vime_core.trainer.profile import cuda_malloc_count

    times, splits, metrics = [], [], {}
    for step in range(a.warmup + a.steps):
        batch = rl_batch(sizes["vocab"], batch_size, a.seq, seed=step, prompt_len=a.prompt_len)
        torch.cuda.synchronize()
        if a.idle_between_steps:  # an idle CPU may clock down or lose its caches, as the loop's trainer's does
            time.sleep(a.idle_between_steps)
        mallocs = cuda_malloc_count()
        t0 = time.perf_counter()
        metrics = trainer.train_step(batch)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        metrics["perf/train_cuda_mallocs"] = float(cuda_malloc_count() - mallocs)  # as the loop's trainer rank reports
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
    flops_6nt = 6 * sizes["active_params"] * tokens
    # causal QK^T + AV, forward + backward
    flops_attn = flops_6nt + 6 * sizes["layers"] * a.seq * sizes["attention_width"] * tokens
    r = {
        "step_s_median": step_s,
        "step_s_all": times,
        "tokens_per_s": tokens / step_s,
        "tflops_6nt": flops_6nt / step_s / 1e12,
        "tflops_with_attention": flops_attn / step_s / 1e12,
        "max_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
        "split": {k: statistics.median(s.get(k, 0.0) for s in splits) for k in sorted({k for s in splits for k in s})},
    }
    r["mfu_6nt"] = r["tflops_6nt"] / peak
    r["mfu_with_attention"] = r["tflops_with_attention"] / peak
    split = ", ".join(f"{k.removeprefix('perf/')} {v:.3f}" for k, v in r["split"].items())
    print(
        f"[{name}] {sizes['params'] / 1e9:.3f} B params ({sizes['active_params'] / 1e9:.3f} B active), "
        f"batch {batch_size}x{a.seq} tokens: median step "
        f"{step_s:.3f} s, {r['tokens_per_s']:.0f} tok/s, {r['tflops_6nt']:.0f} TFLOP/s (6NT) = MFU "
        f"{r['mfu_6nt']:.1%}; with attention FLOPs {r['tflops_with_attention']:.0f} TFLOP/s = "
        f"{r['mfu_with_attention']:.1%}; peak memory {r['max_memory_gib']:.1f} GiB; split: {split}",
        flush=True,
    )
    if a.profile:
        batch = rl_batch(sizes["vocab"], batch_size, a.seq, seed=99, prompt_len=a.prompt_len)
        print(f"[{name}] {batch_size}x{a.seq} profile of one step:\n{profile_step(trainer, batch)}", flush=True)
    torch.cuda.reset_peak_memory_stats()
    return r


if __name__ == "__main__":
    main()
