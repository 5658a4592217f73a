"""One training pass of the ``torch`` trainer backend (fp32 on CPU by default) against this machine's measured matmul
peak: seconds, real and padded tokens, model FLOPs, GFLOP/s and the fraction of the fp32 peak, for the batching
variants side by side (run alternately, so that background load hits every variant alike). Prints numbers; asserts
nothing.

    .venv/bin/python bench/train_pass.py [--model smollm2-135m-instruct] [--prompts 8] [--n 4]
        [--tokens quickstart|random] [--prompt-len 60:140] [--response-len 8:128] [--passes 3]
        [--variants before,padded,packed-foreach,packed] [--micro-batch-size 8] [--threads N] [--profile]

Peak: the best ``torch.mm`` of two square ``n × n`` matrices (``n`` = 1024, 2048, 3072; best of ``--peak-reps``),
``2·n³`` FLOPs, for float32 and bfloat16.

Batch (fixed seed): ``--prompts`` prompts × ``--n`` samples each. ``--tokens quickstart``: the prompts are the
quickstart's training prompts (examples/quickstart/data/train.jsonl) rendered with the model's chat template (real
token ids; ``--prompt-len`` ignored); ``random``: uniform random ids, lengths uniform in ``--prompt-len``. Responses:
random ids, lengths uniform in ``--response-len`` (inclusive). The rollout log-probs are the trainer's own
(left-padded, no-grad, before any pass) and ``--lr`` defaults to 0, so every pass sees the same weights and
``|Δlogp|`` (mean over response tokens, the step's ``train/train_rollout_logprob_abs_diff``) is each variant's
distance from the left-padded path.

Variants (``--variants``, comma-separated): ``before``: left-padded micro-batches, entropies with autograd graph,
foreach AdamW (the backend before issue 18); ``padded``: left-padded, entropies as a no-grad metric, fused AdamW;
``packed-foreach``: one padding-free row per micro-batch, LM head only on response positions, foreach AdamW;
``packed``: the same with fused AdamW (the default now). Besides wall seconds the table gives CPU seconds
(``time.process_time`` of the pass / threads): on a loaded machine the CPU time compares variants more fairly.

What is counted, per pass (one ``TorchTrainer.train_step``: forward + backward of every micro-batch, one AdamW
step; with the default ``--global-batch-size`` and no KL there is no separate old-policy pass):

* ``real tok``: ``sum(len(tokens))`` over the samples; ``padded tok``: ``sum(batch × longest)`` over the
  micro-batches the left-padded layout makes (the same grouping: ``rl_step.micro_batches``).
* model FLOPs ``= 6·N·real_tokens + 6·V·H·M``: ``N`` the non-embedding parameters (every parameter but the token
  embedding, and but ``lm_head`` when it is untied), ``V·H`` the LM head's matmul, ``M = sum(response_length)`` the
  positions whose logits the loss needs. Attention-score FLOPs (``QKᵀ`` and ``A·V``, causal, forward + backward:
  ``6·layers·heads·head_dim·sum(L(L+1)/2)``) are printed apart and not in the fraction; padding, the prompt positions'
  logits of the left-padded path and the optimizer are not counted.
* GFLOP/s = model FLOPs / seconds; ``%peak`` against the fp32 peak measured above.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

import torch

# name → (packed rows, entropies with autograd graph, fused AdamW)
VARIANTS = {
    "before": (False, True, False),
    "padded": (False, False, True),
    "packed-foreach": (True, False, False),
    "packed": (True, False, True),
}
QUICKSTART_DATA = Path(__file__).resolve().parent.parent / "examples" / "quickstart" / "data" / "train.jsonl"


def matmul_peak(dtype: torch.dtype, sizes: tuple[int, ...], reps: int) -> tuple[float, int]:
    """Best ``torch.mm`` GFLOP/s over ``sizes`` and ``reps`` (``2·n³`` FLOPs each) and the size that gave it."""
    best, best_n = 0.0, 0
    for n in sizes:
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        torch.mm(a, b)  # warm-up
        for _ in range(reps):
            t0 = time.perf_counter()
            torch.mm(a, b)
            rate = 2 * n**3 / (time.perf_counter() - t0) / 1e9
            if rate > best:
                best, best_n = rate, n
    return best, best_n


def span(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


def build_samples(a: argparse.Namespace, model_path: Path) -> list:
    from transformers import AutoTokenizer

    from vime_core.types import Sample, Status

    rng = random.Random(a.seed)
    tok = AutoTokenizer.from_pretrained(str(model_path))
    vocab = len(tok)
    if a.tokens == "quickstart":
        rows = [json.loads(line) for line in QUICKSTART_DATA.read_text().splitlines()[: a.prompts]]
        rendered = [tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True) for r in rows]
        prompts = [list(p["input_ids"] if hasattr(p, "keys") else p) for p in rendered]
    else:
        lo, hi = span(a.prompt_len)
        prompts = [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(a.prompts)]
    lo, hi = span(a.response_len)
    samples = []
    for p in prompts:
        for _ in range(a.n):
            s = Sample(tokens=list(p), status=Status.COMPLETED)
            resp = [rng.randrange(vocab) for _ in range(rng.randint(lo, hi))]
            s.append_response_tokens(resp, trainable=True, log_probs=[0.0] * len(resp), weight_version=0)
            samples.append(s)
    return samples


def set_variant(trainer, name: str) -> None:
    packed, entropy_graph, fused = VARIANTS[name]
    trainer.use_packing(packed)
    trainer.always_entropy_graph = entropy_graph
    for group in trainer.optimizer.param_groups:  # read by every AdamW step
        group["fused"], group["foreach"] = fused, not fused


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="known model name or HF directory")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per batch")
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--tokens", choices=("quickstart", "random"), default="quickstart", help="prompt token ids")
    ap.add_argument("--prompt-len", default="60:140", help="LO:HI prompt lengths (--tokens random)")
    ap.add_argument("--response-len", default="8:128", help="LO:HI response lengths (inclusive)")
    ap.add_argument("--micro-batch-size", type=int, default=8, help="samples per micro-batch (quickstart: 8)")
    ap.add_argument("--passes", type=int, default=3, help="timed passes per variant (after one warm-up pass each)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {', '.join(VARIANTS)}")
    ap.add_argument("--dtype", default="float32", help="--train-dtype of the trainer")
    ap.add_argument("--lr", type=float, default=0.0, help="learning rate (0: every pass sees the same weights)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: every core this process may use)")
    ap.add_argument("--peak-reps", type=int, default=5, help="repetitions per matmul size")
    ap.add_argument("--seed", type=int, default=0, help="batch seed")
    ap.add_argument("--profile", action="store_true", help="also print torch.profiler's top ops of one pass each")
    a = ap.parse_args()
    variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    for v in variants:
        if v not in VARIANTS:
            ap.error(f"unknown variant {v!r}; known: {', '.join(VARIANTS)}")

    from vime_core.config import RunConfig
    from vime_core.models import resolve_model
    from vime_core.testing.trainer_args import trainer_args
    from vime_core.trainer.rl_step import micro_batches
    from vime_core.trainer.torch_backend import TorchTrainer
    from vime_core.types import RolloutBatch

    threads = a.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    sizes = (1024, 2048, 3072)
    peak32, n32 = matmul_peak(torch.float32, sizes, a.peak_reps)
    peak16, n16 = matmul_peak(torch.bfloat16, sizes, a.peak_reps)
    print(
        f"matmul peak ({threads} threads): fp32 {peak32:.1f} GFLOP/s (n={n32}), bf16 {peak16:.1f} GFLOP/s (n={n16})",
        flush=True,
    )

    model_path = Path(a.model) if (Path(a.model) / "config.json").is_file() else resolve_model(a.model)
    samples = build_samples(a, model_path)
    trainer = TorchTrainer(
        RunConfig.from_args(
            trainer_args(
                lr=a.lr,
                train_dtype=a.dtype,
                micro_batch_size=a.micro_batch_size,
                train_num_threads=threads,
                rollout_batch_size=a.prompts,
                n_samples_per_prompt=a.n,
            )
        ),
        model_path,
    )
    # rollout log-probs: the left-padded path's, before any pass
    set_variant(trainer, "padded")
    with torch.no_grad():
        for mb in micro_batches(samples, a.micro_batch_size):
            for s, lp in zip(mb, trainer.policy_log_probs(mb, False)[0], strict=True):
                s.rollout_log_probs = lp.tolist()
    rng = random.Random(a.seed + 1)
    batch = RolloutBatch(samples=samples, advantages=[[rng.choice((-1.0, 1.0))] * s.response_length for s in samples])

    model = trainer.model
    cfg = model.config
    hidden, vocab = int(cfg.hidden_size), int(cfg.vocab_size)
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    n_params = sum(p.numel() for p in model.parameters())  # tied weights counted once
    n_nonemb = n_params - embed.numel() - (0 if head is embed else head.numel())
    real = sum(len(s.tokens) for s in samples)
    m = sum(s.response_length for s in samples)
    padded = sum(len(mb) * max(len(s.tokens) for s in mb) for mb in micro_batches(samples, a.micro_batch_size))
    flops = 6 * n_nonemb * real + 6 * vocab * hidden * m
    head_dim = int(getattr(cfg, "head_dim", None) or hidden // cfg.num_attention_heads)
    attn = (
        6
        * cfg.num_hidden_layers
        * cfg.num_attention_heads
        * head_dim
        * sum(len(s.tokens) * (len(s.tokens) + 1) // 2 for s in samples)
    )
    lens = [len(s.tokens) for s in samples]
    print(
        f"batch: {len(samples)} samples ({a.tokens} prompts), lengths {min(lens)}-{max(lens)}, "
        f"{real} real tokens, {padded} left-padded ({100 * (padded - real) / padded:.0f}% padding), "
        f"{m} response tokens; micro-batch {a.micro_batch_size}"
    )
    print(
        f"model: {model_path.name}, {a.dtype}, N = {n_nonemb / 1e6:.1f}M non-embedding params, LM head "
        f"{vocab}×{hidden}; model FLOPs/pass {flops / 1e12:.3f} T (+ attention scores {attn / 1e12:.3f} T, uncounted)"
    )

    times: dict[str, list[float]] = {v: [] for v in variants}
    cpu: dict[str, list[float]] = {v: [] for v in variants}
    diffs: dict[str, float] = {}
    for v in variants:  # warm-up
        set_variant(trainer, v)
        t0 = time.perf_counter()
        trainer.train_step(batch)
        print(f"  warm-up {v}: {time.perf_counter() - t0:.2f} s", flush=True)
    for _ in range(a.passes):
        for v in variants:
            set_variant(trainer, v)
            t0, c0 = time.perf_counter(), time.process_time()
            metrics = trainer.train_step(batch)
            times[v].append(time.perf_counter() - t0)
            cpu[v].append((time.process_time() - c0) / threads)
            print(f"  pass {len(times[v])} {v}: {times[v][-1]:.2f} s, cpu {cpu[v][-1]:.2f} s", flush=True)
            diffs[v] = metrics.get("train/train_rollout_logprob_abs_diff", float("nan"))
    base = statistics.median(times[variants[0]])
    base_cpu = statistics.median(cpu[variants[0]])
    print(
        f"\n{'variant':>15} {'s/pass':>7} {'min s':>7} {'cpu s':>7} {'real tok':>8} {'layout tok':>10} "
        f"{'GFLOP/s':>8} {'%fp32pk':>8} {'speedup':>8} {'cpu spdup':>9} {'|dlogp|':>9}"
    )
    for v in variants:
        med = statistics.median(times[v])
        rate = flops / med / 1e9
        layout = real if VARIANTS[v][0] else padded
        print(
            f"{v:>15} {med:>7.2f} {min(times[v]):>7.2f} {statistics.median(cpu[v]):>7.2f} {real:>8} {layout:>10} "
            f"{rate:>8.1f} {100 * rate / peak32:>7.1f}% {base / med:>7.2f}x "
            f"{base_cpu / statistics.median(cpu[v]):>8.2f}x {diffs[v]:>9.2e}"
        )
    print(f"(medians of {a.passes} passes; speedups relative to {variants[0]}; GFLOP/s from wall seconds)")

    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        for v in variants:
            set_variant(trainer, v)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                trainer.train_step(batch)
            print(f"\n--- profile: {v} ---")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))


if __name__ == "__main__":
    main()
