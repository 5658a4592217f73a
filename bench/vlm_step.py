"""What images cost a step of the ``torch`` trainer on the CPU, with no engine: the per-image data work (decode and
normalise a figure, render a prompt with the processor) and one ``TorchTrainer.train_step`` on the tiny random
Qwen2.5-VL, with the figures and with the same token ids without them (text positions, no vision tower). Prints
numbers; asserts nothing.

    .venv/bin/python bench/vlm_step.py [--prompts 4] [--n 4] [--response-len 32] [--passes 3] [--threads N]

The batch: the first ``--prompts`` rows of examples/geo3k_vlm/data/train.jsonl × ``--n`` samples, random response
ids of ``--response-len`` tokens, rollout log-probs = the trainer's own (lr 0, so every pass sees the same
weights). Needs torchvision (scripts/install.sh installs it; docs/vlm.md).
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--response-len", type=int, default=32)
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from vime_core.data.images import load_image
    from vime_core.data.source import read_rows
    from vime_core.data.vision_prompt import encode_with_images, image_token_id, load_processor
    from vime_core.testing.plugin_context import run_config
    from vime_core.testing.tiny_vlm import build_tiny_vlm
    from vime_core.trainer.torch_backend import TorchTrainer, response_log_probs
    from vime_core.types import RolloutBatch, Sample, Status

    data = ROOT / "examples" / "geo3k_vlm" / "data"
    t0 = time.perf_counter()
    rows = read_rows(data / "train.jsonl", "problem", "answer", "metadata", image_key="images")
    read_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(20):
        load_image("figures/train_000.png", data)
    norm_ms = (time.perf_counter() - t0) / 20 * 1000
    model_dir = build_tiny_vlm(Path(tempfile.mkdtemp()) / "tiny-qwen2.5-vl")
    processor = load_processor(str(model_dir))
    t0 = time.perf_counter()
    prompts = [encode_with_images(processor, r["prompt"], r["images"]) for r in rows[: args.prompts]]
    encode_ms = (time.perf_counter() - t0) / args.prompts * 1000
    pad = image_token_id(processor)
    print(
        f"read_rows of {len(rows)} rows with their figures: {read_s:.2f} s; normalise one 224x224 figure: "
        f"{norm_ms:.1f} ms; processor prompt ids per prompt: {encode_ms:.1f} ms"
    )
    print(f"prompt tokens: {[len(x) for x in prompts]} (image tokens {[x.count(pad) for x in prompts]})")

    trainer = TorchTrainer(run_config(lr=0.0, micro_batch_size=args.prompts * args.n), model_dir)
    rng = random.Random(0)

    def batch(with_images: bool) -> RolloutBatch:
        samples = []
        for i, (ids, row) in enumerate(zip(prompts, rows, strict=False)):
            for j in range(args.n):
                resp = [rng.randrange(5, 4000) for _ in range(args.response_len)]
                s = Sample(index=j, group_index=i, tokens=list(ids), images=list(row["images"]) if with_images else [])
                if not with_images:  # the same ids, every image token a text token
                    s.tokens = [5 if t == pad else t for t in s.tokens]
                s.status = Status.COMPLETED
                s.append_response_tokens(resp, trainable=True, log_probs=[0.0] * len(resp), weight_version=0)
                samples.append(s)
        with torch.no_grad():
            lps, _ = response_log_probs(trainer.model, samples, trainer.device)
        for s, lp in zip(samples, lps, strict=True):
            s.rollout_log_probs = lp.tolist()
        adv = [[1.0 if k % 2 else -1.0] * s.response_length for k, s in enumerate(samples)]
        return RolloutBatch(samples, adv)

    runs: dict[str, list[float]] = {"images": [], "no images": []}
    batches = {"images": batch(True), "no images": batch(False)}
    for _ in range(args.passes):
        for name, b in batches.items():  # alternately, so background load hits both alike
            t0 = time.perf_counter()
            m = trainer.train_step(b)
            runs[name].append(time.perf_counter() - t0)
            assert m["train/train_rollout_logprob_abs_diff"] < 1e-5
    n = args.prompts * args.n
    for name, secs in runs.items():
        print(
            f"train_step, {n} samples {name}: median {statistics.median(secs):.3f} s (passes: "
            f"{', '.join(f'{x:.3f}' for x in secs)})"
        )


if __name__ == "__main__":
    main()
