"""Bytes and seconds of ``disk`` vs ``disk-delta`` weight sync on SmolLM2-135M-Instruct after torch-trainer steps.

Trains the real torch trainer (AdamW, ``--lr``, default 1e-6 = vime's default) on a synthetic RL batch and, after every
step, pushes the weights through ``disk`` (full safetensors) and ``disk-delta`` (each ``--encodings``, each diffing
against the previous version, as in a run). Reports, after step 1 and step ``--steps``: bytes written, the delta's
share of the full bytes, trainer-side seconds (encode + write) and receiver-side seconds (read; for disk-delta:
decode + verify every checksum, no vLLM involved). Asserts nothing; prints a table.

    .venv/bin/python bench/weight_sync.py [--steps 10] [--dtypes float32,bfloat16] [--encodings sub,xor,overwrite]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch

from vime_core.cli.arguments import default_args
from vime_core.config import RunConfig


def trainer_args(dtype: str, lr: float, threads: int | None) -> argparse.Namespace:
    from vime_core.testing.trainer_args import trainer_args as base

    return base(train_num_threads=threads, train_dtype=dtype, lr=lr, micro_batch_size=4)


def rl_batch(vocab: int, step: int, n: int, prompt_len: int, resp_len: int):
    """``n`` samples of random prompt/response tokens with ±1 advantages (GRPO-like), fixed per step."""
    from vime_core.types import RolloutBatch, Sample, Status

    g = torch.Generator().manual_seed(1000 + step)
    samples, advs = [], []
    for i in range(n):
        s = Sample(
            group_index=0,
            index=i,
            tokens=torch.randint(0, vocab, (prompt_len,), generator=g).tolist(),
            status=Status.COMPLETED,
            reward=float(i % 2),
        )
        s.append_response_tokens(
            torch.randint(0, vocab, (resp_len,), generator=g).tolist(),
            trainable=True,
            log_probs=[-1.0] * resp_len,
            weight_version=step,
        )
        samples.append(s)
        advs.append([1.0 if i % 2 else -1.0] * resp_len)
    return RolloutBatch(samples=samples, advantages=advs)


def run(dtype: str, a: argparse.Namespace, model_dir: Path) -> list[dict]:
    from vime_core.trainer.torch_backend import TorchTrainer
    from vime_core.weight_sync.disk import DiskWeightSync
    from vime_core.weight_sync.disk_delta import DiskDeltaWeightSync

    work = Path(tempfile.mkdtemp(prefix="vime-bench-ws-"))
    trainer = TorchTrainer(RunConfig.from_args(trainer_args(dtype, a.lr, a.threads)), model_dir)
    vocab = int(trainer.model.config.vocab_size)
    strategies = {"disk": DiskWeightSync(RunConfig.from_args(default_args(update_weight_disk_dir=work / "disk")))}
    for enc in a.encodings.split(","):
        strategies[f"disk-delta/{enc}"] = DiskDeltaWeightSync(
            RunConfig.from_args(
                default_args(
                    update_weight_disk_dir=work / enc,
                    update_weight_delta_encoding=enc,
                    update_weight_delta_base=model_dir,
                )
            )
        )
    rows = []
    try:
        for step in range(1, a.steps + 1):
            t0 = time.perf_counter()
            trainer.train_step(rl_batch(vocab, step, a.samples, a.prompt_len, a.response_len))
            train_s = time.perf_counter() - t0
            report = step in (1, a.steps)
            line = []
            for name, strat in strategies.items():
                update = strat.push(trainer.named_hf_tensors(), step)
                t1 = time.perf_counter()
                if name != "disk" or report:
                    strat.read(update)  # the delta receiver must follow every version
                read_s = time.perf_counter() - t1
                full = update.payload.get("full_bytes", update.num_bytes)
                line.append(f"{name} {update.num_bytes:,} B ({update.num_bytes / full:.1%}), {update.seconds:.2f} s")
                if report:
                    rows.append(
                        {
                            "dtype": dtype,
                            "step": step,
                            "strategy": name,
                            "bytes": update.num_bytes,
                            "full_bytes": full,
                            "changed_bytes": update.payload.get("changed_bytes", full),
                            "push_s": update.seconds,
                            "read_s": read_s,
                            "train_s": train_s,
                        }
                    )
                strat.cleanup(update)
            print(f"[{dtype}] step {step}/{a.steps} trained in {train_s:.1f} s; " + "; ".join(line), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--encodings", default="sub,xor,overwrite")
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--response-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    from vime_core.models import resolve_model

    model_dir = resolve_model(a.model)
    rows = []
    for dtype in a.dtypes.split(","):
        rows += run(dtype, a, model_dir)
        table(rows, a, model_dir)


def table(rows: list[dict], a: argparse.Namespace, model_dir: Path) -> None:
    print(
        f"\nweight sync on {a.model} ({model_dir}), torch trainer, AdamW lr {a.lr:g}, "
        f"{a.samples}x({a.prompt_len}+{a.response_len}) tokens per step"
    )
    print(
        f"{'dtype':>9} {'step':>4} {'strategy':>20} {'bytes':>12} {'full bytes':>12} {'ratio':>7} "
        f"{'changed':>7} {'push s':>7} {'read s':>7}"
    )
    for r in rows:
        ratio = r["bytes"] / max(r["full_bytes"], 1)
        changed = r["changed_bytes"] / max(r["full_bytes"], 1)
        print(
            f"{r['dtype']:>9} {r['step']:>4} {r['strategy']:>20} {r['bytes']:>12,} {r['full_bytes']:>12,} "
            f"{ratio:>7.1%} {changed:>7.1%} {r['push_s']:>7.2f} {r['read_s']:>7.2f}"
        )
    print(
        "ratio = bytes written / full tensor bytes; changed = bytes that differ from the previous version. "
        "Target: disk-delta <= 30% of full bytes."
    )


if __name__ == "__main__":
    main()
