"""Samples/s of ``--loop sync`` vs ``one-step-off`` vs ``fully-async`` on SmolLM2-135M-Instruct, this CPU.

Runs ``vime run --config examples/fully_async/config.yaml --loop MODE`` once per mode (the config pins the vLLM
engine's worker to core 0 with ``--rollout-cpu-bind`` and the trainer to core 1 with ``--train-cpus``, so
generation and training can overlap), then prints, per mode, the trained samples per second of the loop and the
ratio to sync. Throughput is measured in steady state: the loop's wall time is the sum of ``perf/step_time``
(each step = wait for groups + train + weight sync; the driver runs steps one after the other), over the steps
after the first (the first includes the cold start of generation in every mode).

    .venv/bin/python bench/loop_modes.py [--steps 6] [--modes sync fully-async] [-- extra flags]

Extra flags after ``--`` go to every ``vime run`` (e.g. ``-- --rollout-batch-size 8``). Each figure is printed as
soon as its run ends; a summary JSON line closes the output.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "fully_async" / "config.yaml"


def vime_run(config: Path | None, steps: int, out: Path, flags: list[str]) -> tuple[list[dict[str, float]], float]:
    """Run ``vime run [--config CONFIG] --num-rollout STEPS --output-dir OUT --no-resume --no-save-hf FLAGS`` with
    this interpreter and read back its per-step metrics.

    Returns:
        ``(rows, wall)``: one dict per step from ``OUT/metrics.jsonl`` (``perf/*`` in seconds, ``rollout/*``,
        ``train/*``), and the wall seconds of the whole command (engine start-up included).

    Raises:
        SystemExit: the run exited non-zero (the message holds the tails of its stdout and stderr).
    """
    cmd = [sys.executable, "-m", "vime_core.cli", "run", *(["--config", str(config)] if config else [])]
    cmd += ["--num-rollout", str(steps), "--output-dir", str(out), "--no-resume", "--no-save-hf", *flags]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"vime run exited {proc.returncode}: {cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()], wall


def run_mode(mode: str, steps: int, out: Path, extra: list[str]) -> dict[str, float]:
    """One ``vime run`` in ``mode``; returns its steady-state figures (from ``metrics.jsonl``)."""
    rows, wall = vime_run(CONFIG, steps, out, ["--loop", mode, *extra])
    steady = rows[1:] or rows
    samples = sum(r.get("rollout/num_samples", 0.0) for r in steady)
    seconds = sum(r["perf/step_time"] for r in steady)
    return {
        "samples_per_s": samples / seconds,
        "step_s": seconds / len(steady),
        "samples": samples,
        "wait_s": sum(r.get("perf/rollout_time", 0.0) for r in steady) / len(steady),
        "train_s": sum(r.get("perf/train_time", 0.0) for r in steady) / len(steady),
        "sync_s": sum(r.get("perf/sync_time", 0.0) for r in steady) / len(steady),
        "staleness_max": max(r.get("rollout/staleness_max", 0.0) for r in rows),
        "reward_mean": sum(r.get("rollout/reward_mean", 0.0) for r in rows) / len(rows),
        "run_wall_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="steps per run (the first is not timed)")
    parser.add_argument("--modes", nargs="+", default=["sync", "one-step-off", "fully-async"])
    parser.add_argument("--out-dir", type=Path, default=Path("/tmp/vime-bench-loop-modes"))
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    print(f"cores: {os.cpu_count()}, config: {CONFIG.relative_to(ROOT)}, steps: {args.steps}, extra: {extra}")
    results: dict[str, dict[str, float]] = {}
    for mode in args.modes:
        r = run_mode(mode, args.steps, args.out_dir / mode, extra)
        results[mode] = r
        print(
            f"{mode:>12}: {r['samples_per_s']:.3f} samples/s | {r['step_s']:.1f} s/step (wait {r['wait_s']:.1f}, "
            f"train {r['train_s']:.1f}, sync {r['sync_s']:.1f}) | staleness max {r['staleness_max']:.0f} | "
            f"reward {r['reward_mean']:.3f} | run {r['run_wall_s']:.0f} s",
            flush=True,
        )
    if "sync" in results:
        base = results["sync"]["samples_per_s"]
        for mode, r in results.items():
            if mode != "sync":
                print(f"{mode} / sync = {r['samples_per_s'] / base:.2f}x", flush=True)
    print(json.dumps({"loop_modes": results}))


if __name__ == "__main__":
    main()
